"""One tensor-parallel plan places each parameter alike on the three backends: every family's own plan (its
base_model_tp_plan) run through each backend's placement code — torch's `apply_tensor_parallel` on a model on
the meta device over a fake 2-rank process group, xla's partition specs, flax's shardings — gives each
parameter of the base model the same dimension over tp (in torch's layout), and the same parameters whole on
every tp rank. Names and shapes only: no weights, no devices.

What is compared is the plan's split. Where FSDP stores the rest differs by design (torch: dimension 0 over
fsdp, xla: every device of a replica, tp included, flax: the shard axes), and torch's output projection, split
over the vocabulary for `loss_parallel`, lies outside the base model the plan is written against.
"""
import numpy as np
import pytest

from portable_fsdp.plan import MeshSpec
from tests.parity import families

TP = 2
MESH = MeshSpec(fsdp_size=2, tp_size=TP).resolve(4)
# Every family the backends train (tests/parity/families.py; GPT-2 ships no plan, so tp is refused for it) and
# Qwen3-MoE (portable_fsdp/configs/qwen3_30b_a3b.py): q/k norms whole with their gradients summed, dense keys beside experts.
PLANNED = tuple(f for f in families.FAMILIES if f != "gpt2") + ("qwen3_moe",)
FLAX_BUILDS = ("llama", "qwen2", "mistral", "mixtral")  # portable_fsdp/backends/flax/architecture.py: FLAX_FAMILIES
# A plan a user writes: the embedding split by vocabulary (an embedding is [vocab, hidden], no Linear).
USER_PLAN = {"embed_tokens": "rowwise", **{f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
             "layers.*.self_attn.o_proj": "rowwise"}


def hf_config(family: str):
    if family == "qwen3_moe":
        from transformers import AutoConfig

        return AutoConfig.for_model("qwen3_moe", **families.SHAPE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=96)
    return families.hf_config(family)


def meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def tp_mesh():
    """A 2-rank tp mesh in this one process: torch's fake process group records placements, sends nothing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def torch_split(config, tp_plan: dict, tp_mesh, strict: bool = False) -> dict:
    """{parameter of the base model: the dimension torch's DTensor shards over tp, or None}; `strict` as for a
    plan the user wrote (portable_fsdp/backends/torch/parallelize.py)."""
    from torch.distributed.tensor import DTensor, Shard

    from portable_fsdp.backends.torch.tensor_parallel import apply_tensor_parallel

    model = meta_model(config)
    apply_tensor_parallel(model, tp_mesh, tp_plan, strict=strict)
    split = {}
    for name, param in model.base_model.named_parameters():
        placements = param.placements if isinstance(param, DTensor) else ()
        split[name] = next((p.dim for p in placements if isinstance(p, Shard)), None)
    return split


def xla_split(config, tp_plan: dict) -> dict:
    """{parameter of the base model: the dimension its partition spec puts tp alone on, or None} (the axes
    FSDPv2 stores a parameter over, tp among them, are a tuple)."""
    from portable_fsdp.backends.xla import layout

    model = meta_model(config)
    in_base = layout.base_model_names(model)
    specs = layout.parameter_specs(model, tp_plan, 0, MESH)
    return {in_base(name): next((d for d, entry in enumerate(spec) if entry == "tp"), None)
            for name, spec in specs.items() if in_base(name) is not None}


def flax_split(config, tp_plan: dict) -> dict:
    """{torch name of the base model's parameter: the torch dimension flax's sharding puts tp on, or None}."""
    import jax

    from portable_fsdp.backends.flax import architecture, torch_weights, model as model_lib, sharding

    shapes = model_lib.define(architecture.from_hf_config(config)).shapes
    mesh = sharding.build_mesh(MESH, [jax.devices()[0]] * MESH.fsdp_size * TP)  # placements only
    placed = sharding.param_shardings(shapes, mesh, tp_plan, torch_weights.torch_name)
    split = {}
    for name, shape in shapes.items():
        torch_name = torch_weights.torch_name(name)
        if torch_name.startswith(sharding.BASE_MODEL):
            dim = next((d for d, entry in enumerate(placed[name].spec) if entry == "tp"), None)
            split[torch_name.removeprefix(sharding.BASE_MODEL)] = None if dim is None else \
                torch_dim(name, shape.shape, dim)
    return split


def torch_dim(flax_name: str, flax_shape: tuple, flax_dim: int) -> int:
    """The dimension of the torch tensor along which flax's `flax_dim` runs (through convert's layout change)."""
    from portable_fsdp.backends.flax import torch_weights

    coordinate = torch_weights.to_torch_layout(flax_name, np.indices(flax_shape)[flax_dim])
    (dim,) = [d for d in range(coordinate.ndim) if np.ptp(coordinate, axis=d).any()]
    return dim


@pytest.mark.parametrize("family", PLANNED)
def test_every_family_plan_splits_the_same_dimensions_on_every_backend(family, tp_mesh):
    config = hf_config(family)
    tp_plan = dict(config.base_model_tp_plan)
    on_torch, on_xla = torch_split(config, tp_plan, tp_mesh), xla_split(config, tp_plan)
    assert on_xla == on_torch
    if family in FLAX_BUILDS:
        assert flax_split(config, tp_plan) == on_torch
    # what the plan says, read in torch's layout: attention and dense MLPs split Megatron-style, the rest whole
    layer = {name.removeprefix("layers.0."): dim for name, dim in on_torch.items() if name.startswith("layers.0.")}
    assert layer["self_attn.q_proj.weight"] == 0 and layer["self_attn.o_proj.weight"] == 1
    assert layer["input_layernorm.weight"] is None and on_torch["embed_tokens.weight"] is None
    assert all(dim is None for name, dim in layer.items() if ".experts." in name or "_norm" in name), layer


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_a_users_plan_splitting_the_embedding_is_placed_alike(family, tp_mesh):
    config = hf_config(family)
    on_torch = torch_split(config, USER_PLAN, tp_mesh, strict=True)
    assert on_torch["embed_tokens.weight"] == 0  # by vocabulary
    assert xla_split(config, USER_PLAN) == flax_split(config, USER_PLAN) == on_torch
