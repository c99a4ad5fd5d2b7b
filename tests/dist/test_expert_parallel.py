"""Expert parallelism (plan.ep_size) on gloo ranks against the single-process reference (tests/parity/reference.py):
tiny MoE models (4 experts, top-2) trained 20 steps in fp32 under each variant of expert_parallel_check.py — the
losses within 1e-5 of one process's, the eval loss before training one process's, and the experts split over the
ep ranks (and sharded again only over the ranks holding the same experts), each weight's full value the unsharded model's.
The router's load-balancing loss (output_router_logits, weight 0.1 so that it shapes every update; averaged per
rank instead it moves the losses by ~2e-3) is on unless a variant's model says otherwise.

The default suite runs ep2 and fsdp1_tp2_ep2 (the ep ranks taken from fsdp × tp) on 2 ranks; `slow` runs the rest:
without the router loss, ep inside a larger fsdp, ep = fsdp = 4, with cp, sp, tp (ep = tp inside fsdp 2, ep 4 =
fsdp 2 × tp 2, HSDP × tp; under tp also checkpointing, bf16 and an odd token count that the tp pair slices
unevenly) and HSDP, activation checkpointing, rank-0 loading, CPU offload, gradient accumulation, bf16, and
Qwen3-MoE."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist.expert_parallel_check import EVAL_SEQUENCES, VARIANTS
from tests.dist.launch import torchrun
from tests.parity import families
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

STEPS = 20
FP32_RTOL = 1e-5
BF16_RTOL = 2.0**-8  # one bf16 rounding step, as tests/dist/test_fsdp_parity.py
HERE = os.path.dirname(__file__)
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.1)
# family and config overrides of each model directory the variants name
MODELS = {"mixtral": ("mixtral", {}), "mixtral_router": ("mixtral", ROUTER),
          "qwen3_moe_router": ("qwen3_moe", dict(ROUTER, num_experts=4, num_experts_per_tok=2, head_dim=16,
                                                 moe_intermediate_size=48))}
FAST_VARIANTS = ["ep2", "fsdp1_tp2_ep2"]
SLOW_VARIANTS = [name for name in VARIANTS if name not in FAST_VARIANTS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("moe")
    for name, (family, overrides) in MODELS.items():
        families.save_model(family, directory / name, **overrides)
    return directory


def run_variants(tmp_dir, models, names: list) -> dict:
    """Every variant of `names` under torchrun, one process group per world size."""
    results = {}
    for world in sorted({VARIANTS[n].world for n in names}):
        out = tmp_dir / f"results-{world}.json"
        torchrun(world, os.path.join(HERE, "expert_parallel_check.py"), str(out), str(STEPS), str(models),
                 *[n for n in names if VARIANTS[n].world == world])
        results.update(json.loads(out.read_text()))
    return results


def config_of(models, name: str):
    """The single-process reference's config: the variant's model and train fields, not its plan."""
    variant = VARIANTS[name]
    overrides = {k: v for k, v in variant.overrides.items() if not k.startswith("plan.")}
    return make_config({**overrides, "model.init_from": str(models / variant.model)})


def single_process_eval_loss(config) -> float:
    """Σ token losses / Σ label tokens of the unsharded model over the eval batches the ranks split."""
    from portable_fsdp.backends.hf_torch.model import create_model
    from portable_fsdp.data.batch import IGNORE_INDEX
    from portable_fsdp.data.batch import EvalBatches
    from portable_fsdp.data.loader import build_token_data

    model = create_model(config, rank=0, rank0_only=False).eval()
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in EvalBatches(data.eval[:EVAL_SEQUENCES], config.train.eval_batch_size, 0, 1):
            logits = model(input_ids=torch.from_numpy(batch.input_ids), use_cache=False).logits
            total += F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch.labels).flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += batch.num_label_tokens
    return total / tokens


def expected_local_fraction(name: str) -> float:
    """Each expert element lives on one rank of ep (tp ranks included) × the ranks holding the same experts
    (efsdp × cp|sp): the world but its HSDP replicas, which hold copies."""
    overrides, world = VARIANTS[name].overrides, VARIANTS[name].world
    return int(overrides.get("plan.dp_replicate_size", 1)) / world


def check(models, name: str, result: dict) -> None:
    assert result["on_ep_mesh"] and result["split_once"] and result["equal_to_unsharded"]
    assert result["local_fraction"] == pytest.approx(expected_local_fraction(name))
    config, bf16 = config_of(models, name), VARIANTS[name].bf16
    rtol = BF16_RTOL if bf16 else FP32_RTOL
    assert result["initial_eval"]["eval_loss"] == pytest.approx(single_process_eval_loss(config), rel=rtol)
    deviation = max_relative_difference(result["losses"], reference_losses(config, STEPS))
    assert len(result["losses"]) == STEPS
    assert deviation <= rtol
    if bf16:
        assert deviation > 1e-6, "bf16 run is bit-identical to fp32: mixed precision was not applied"


@pytest.fixture(scope="module")
def fast_results(tmp_path_factory, models):
    return run_variants(tmp_path_factory.mktemp("ep_fast"), models, FAST_VARIANTS)


@pytest.mark.parametrize("name", FAST_VARIANTS)
def test_expert_parallel_trains_like_one_process(fast_results, models, name):
    """ep2: ep = fsdp = 2, each rank holds 2 of the 4 experts; tokens cross to the other rank and back, and the
    router's load-balancing loss counts the choices of both ranks' tokens. fsdp1_tp2_ep2: the two ranks are one
    tp group sharing its tokens, the experts split over it; each rank sends its half of the tokens, so every
    token reaches its experts once and their gradients count it once."""
    check(models, name, fast_results[name])


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory, models):
    return run_variants(tmp_path_factory.mktemp("ep_slow"), models, SLOW_VARIANTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_VARIANTS)
def test_expert_parallel_variant_trains_like_one_process(slow_results, models, name):
    check(models, name, slow_results[name])


def meta_model(family: str, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config))


def test_a_model_without_fused_experts_is_refused_by_the_lowering():
    """(The start-up check refuses ep on a model whose config counts no experts before any worker starts.)"""
    from portable_fsdp.backends.torch.expert_parallel import apply_expert_parallel
    from portable_fsdp.errors import UserError

    with pytest.raises(UserError, match="LlamaForCausalLM keeps no fused experts module"):
        apply_expert_parallel(meta_model("llama", **families.SHAPE), ep_mesh=None)


@pytest.mark.slow  # building gpt-oss imports its modeling code: ~6 s
def test_experts_in_a_layout_the_lowering_does_not_split_are_refused():
    """gpt-oss keeps biases and [in, out] weights beside its fused experts: refused before anything is split."""
    from portable_fsdp.backends.torch.expert_parallel import apply_expert_parallel
    from portable_fsdp.errors import UserError

    gpt_oss = meta_model("gpt_oss", **families.SHAPE, num_local_experts=4, head_dim=16,
                         layer_types=["full_attention"] * 2)
    with pytest.raises(UserError, match="GptOssExperts stores its experts in a layout expert parallelism does not "
                                        "split yet"):
        apply_expert_parallel(gpt_oss, ep_mesh=None)


def expert_groups(spec, rank: int) -> tuple:
    """(ep group, expert FSDP group) of `rank`, global ranks in mesh order, built as `rank` of a world of fake
    ranks in this one process (torch's fake process group builds meshes, sends nothing)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import _mesh_resources
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from portable_fsdp.backends.torch.mesh import expert_meshes

    # torch caches a flattened mesh per mesh of equal ranks and names, whatever this process's rank: a process
    # that is every rank in turn must forget the last one's
    _mesh_resources.root_to_flatten_mapping.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        ep, expert_dp = expert_meshes(spec, "cpu")
        return ep.mesh.flatten().tolist(), expert_dp.mesh.flatten().tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [dict(fsdp_size=2, sp_size=2, tp_size=2, ep_size=4),
                                   dict(dp_replicate_size=2, fsdp_size=2, tp_size=2, ep_size=2),
                                   dict(fsdp_size=4, tp_size=2, ep_size=4), dict(fsdp_size=8, ep_size=4)])
def test_an_ep_group_is_part_of_the_fsdp_ranks_times_their_tp_ranks(sizes):
    """Hugging Face's layout: ep rank = (fsdp rank mod ep/tp) × tp + tp rank, over ranks of the same replica,
    outer fsdp part and cp|sp coordinate (sp lies between fsdp and tp in rank order); the experts' FSDP mesh is
    the ranks of the same ep rank: the outer fsdp part × cp|sp (× the replicas)."""
    from portable_fsdp.plan import MeshSpec

    spec = MeshSpec(**sizes).resolve(8)
    part = spec.ep_fsdp_size

    def outside_ep(rank):
        c = spec.coordinates(rank)
        return c["dp_replicate"], c["fsdp"] // part, c["sp"]

    def ep_rank(rank):
        c = spec.coordinates(rank)
        return c["fsdp"] % part * spec.tp_size + c["tp"]

    for rank in range(8):
        ep, expert_dp = expert_groups(spec, rank)
        assert [ep_rank(r) for r in ep] == list(range(spec.ep_size))
        assert rank in ep and {outside_ep(r) for r in ep} == {outside_ep(rank)}
        assert rank in expert_dp and {ep_rank(r) for r in expert_dp} == {ep_rank(rank)}
        assert len(expert_dp) == spec.dp_replicate_size * spec.expert_fsdp_size * spec.sequence_size
