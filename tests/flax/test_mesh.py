"""The whole plan as one JAX mesh: every device at the coordinates portable_fsdp.plan gives its rank, the tensor-
parallel plan's patterns resolved to parameters, and what XLA makes of the placements (Ulysses SP's all-to-alls,
EP moving tokens rather than expert weights). The placements of whole models: the golden files of test_sharding.py;
the losses of every mesh: test_parity.py and test_model_families.py."""
import re

import numpy as np
import pytest

from portable_fsdp.plan import MeshSpec
from tests.flax.conftest import init_state, make_config, needs_devices
from tests.parity import families

LLAMA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.mlp.down_proj": "rowwise"}
MIXTRAL_PLAN = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
                "layers.*.mlp.experts": "moe_tp_experts"}


@needs_devices(4)
@pytest.mark.parametrize("spec", [MeshSpec(dp_replicate_size=2, fsdp_size=2), MeshSpec(fsdp_size=4, ep_size=2),
                                  MeshSpec(fsdp_size=2, tp_size=2), MeshSpec(fsdp_size=2, sp_size=2),
                                  MeshSpec(fsdp_size=2, tp_size=2, ep_size=4)])
def test_each_device_sits_at_its_ranks_coordinates(spec):
    """Rank r (device r) is where MeshSpec.coordinates(r) puts it; ep is the inner part of fsdp an ep group spans
    (ep_size / tp_size of it)."""
    import jax

    from portable_fsdp import placement
    from portable_fsdp.backends.flax import sharding

    spec = spec.resolve(4)
    mesh = sharding.build_mesh(spec, jax.devices()[:4])
    assert mesh.axis_names == placement.MESH_AXES
    for rank in range(4):
        c = spec.coordinates(rank)
        fsdp_outer, ep = divmod(c["fsdp"], spec.ep_fsdp_size)
        assert mesh.devices[c["dp_replicate"], fsdp_outer, ep, c["cp"], c["sp"], c["tp"]] == jax.devices()[rank]


def test_tensor_parallel_patterns_name_modules_and_parameters():
    """Flax kernels are [in, out]: colwise splits the last dimension, rowwise the one before."""
    from portable_fsdp.backends.flax.sharding import tp_dim

    assert tp_dim("model.layers.11.self_attn.q_proj.weight", 2, LLAMA_PLAN) == 1
    assert tp_dim("model.layers.0.self_attn.q_proj.bias", 1, LLAMA_PLAN) == 0  # the module's bias too
    assert tp_dim("model.layers.0.mlp.down_proj.weight", 2, LLAMA_PLAN) == 0
    assert tp_dim("model.layers.0.self_attn.k_proj.weight", 2, LLAMA_PLAN) is None
    assert tp_dim("model.layers.0.self_attn.q_proj_extra.weight", 2, LLAMA_PLAN) is None  # whole names only
    assert tp_dim("lm_head.weight", 2, {"lm_head": "colwise"}) is None  # patterns are relative to the base model
    assert tp_dim("model.layers.1.mlp.experts.gate_up_proj", 4, MIXTRAL_PLAN) is None  # experts: whole over tp
    assert tp_dim("model.layers.1.mlp.gate.weight", 2, MIXTRAL_PLAN) is None


def placed_parameters(spec: MeshSpec) -> dict:
    """{parameter: spec as JSON} of a Mixtral layer's parameters on the resolved `spec` (8 devices)."""
    import jax

    from portable_fsdp import placement
    from portable_fsdp.backends.flax import torch_weights, sharding

    mesh = sharding.build_mesh(spec, [jax.devices()[0]] * 8)  # placements only: no array is placed
    shapes = {"model.layers.0.self_attn.q_proj.kernel": (64, 64), "model.layers.0.self_attn.q_proj.bias": (64,),
              "model.layers.0.self_attn.o_proj.kernel": (64, 64), "model.layers.0.self_attn.o_proj.bias": (64,),
              "model.layers.0.mlp.experts.gate_up_proj": (4, 2, 64, 160),
              "model.layers.0.mlp.experts.down_proj": (4, 160, 64), "model.layers.0.mlp.gate.kernel": (64, 4)}
    shapes = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes.items()}
    return sharding.describe(sharding.param_shardings(shapes, mesh, {**LLAMA_PLAN, **MIXTRAL_PLAN},
                                                      torch_weights.torch_name, placement.expert_axes(spec)))


def test_placement_of_tensor_and_expert_parallel_parameters():
    """colwise on the output dimension, rowwise on the input one, fsdp on another; experts over ep × tp (ep 4 =
    2 of the 4 fsdp ranks × tp 2), never cut by tp."""
    placed = placed_parameters(MeshSpec(fsdp_size=4, ep_size=4, tp_size=2).resolve(8))
    assert placed == {
        "model.layers.0.self_attn.q_proj.kernel": [["fsdp", "ep"], "tp"],
        "model.layers.0.self_attn.q_proj.bias": ["tp"],
        "model.layers.0.self_attn.o_proj.kernel": ["tp", ["fsdp", "ep"]],
        "model.layers.0.self_attn.o_proj.bias": [None],  # added after the reduction: whole on every tp rank
        "model.layers.0.mlp.experts.gate_up_proj": [["ep", "tp"], None, None, "fsdp"],  # the rest of fsdp on the
        "model.layers.0.mlp.experts.down_proj": [["ep", "tp"], "fsdp", None],  # largest other dimension
        "model.layers.0.mlp.gate.kernel": [None, None]}  # small: whole


def test_experts_split_over_tp_only_under_expert_parallelism():
    """ep = tp: the ep group is the tp group (the mesh's ep axis is 1); tp alone leaves the experts whole."""
    ep_is_tp = placed_parameters(MeshSpec(fsdp_size=4, ep_size=2, tp_size=2).resolve(8))
    assert ep_is_tp["model.layers.0.mlp.experts.down_proj"] == ["tp", "fsdp", None]
    tp_alone = placed_parameters(MeshSpec(fsdp_size=4, tp_size=2).resolve(8))
    assert tp_alone["model.layers.0.mlp.experts.down_proj"] == [None, "fsdp", None]


def test_a_tensor_parallel_plan_that_cannot_split_is_refused():
    import jax

    from portable_fsdp.backends.flax import sharding
    from portable_fsdp.errors import UserError

    mesh = sharding.build_mesh(MeshSpec(fsdp_size=1, tp_size=2).resolve(2), [jax.devices()[0]] * 2)
    shapes = {"model.layers.0.mlp.down_proj.kernel": jax.ShapeDtypeStruct((33, 64), np.float32)}
    with pytest.raises(UserError, match="plan.tp_size: 2 does not divide model.layers.0.mlp.down_proj.kernel"):
        sharding.param_shardings(shapes, mesh, LLAMA_PLAN)
    with pytest.raises(UserError, match="plan.tp_plan: names none of the model's parameters"):
        sharding.param_shardings(shapes, mesh, {"layers.*.attention.wq": "colwise"})


def compiled_train_step(state) -> str:
    import jax

    from portable_fsdp.backends.flax import sharding

    rows = jax.device_put(np.zeros((1, 4, 64), np.int32), sharding.batch_sharding(state.ctx.mesh, 1))
    return state.ctx.programs.train.lower(state.params, state.opt_state, rows, rows, rows, np.float32(4.0),
                                          np.float32(1e-3)).compile().as_text()


def collectives(hlo: str, kind: str) -> list:
    """(result shapes, op_name) of each `kind` collective of a compiled program."""
    pattern = rf"= (\([^)]*\)|\S+) {kind}(?:-start)?\(.*?op_name=\"([^\"]+)\""
    return re.findall(pattern, hlo)


@pytest.mark.slow
@needs_devices(2)
def test_ulysses_attention_exchanges_sequence_for_heads_with_all_to_alls():
    """q, k and v go from the sequence split to the heads split (and their gradients back) by all-to-all: four
    per layer (q, and k and v, forward and backward) with a [.., 32 tokens, 1 kv head or 2 heads, 16] block."""
    hlo = compiled_train_step(init_state(make_config({"plan.sp_size": 2}), 2))
    exchanges = [shape for shape, name in collectives(hlo, "all-to-all") if name.endswith("sharding_constraint")]
    assert len(exchanges) == 3 * 2 * 2, exchanges
    assert all(re.search(r"f32\[4,\d+,\d+,[12],16\]", shape) for shape in exchanges)


@pytest.mark.slow
@needs_devices(2)
@pytest.mark.parametrize("plan, expert_axes, exchange", [
    ({"plan.ep_size": 2}, "ep", "all-to-all"),  # fsdp ranks hold different tokens: sent to their experts and back
    ({"plan.ep_size": 2, "plan.tp_size": 2}, "tp", "all-reduce")])  # tp ranks share theirs: outputs summed over tp
def test_expert_parallelism_moves_tokens_not_expert_weights(tmp_path_factory, plan, expert_axes, exchange):
    """ep 2 out of fsdp 2: the tokens travel to the experts. ep 2 = tp 2 (fsdp 1): every device holds every token
    already; each runs its experts on them and the experts' outputs are summed over tp. Never are the expert
    weights gathered."""
    model = families.saved(tmp_path_factory, "mixtral")
    state = init_state(make_config({**families.overrides(model), **plan}), 2)
    assert state.params["model.layers.0.mlp.experts.down_proj"].sharding.spec[0] == expert_axes
    hlo = compiled_train_step(state)
    gathered = [shape for shape, _ in collectives(hlo, "all-gather")]
    assert not [s for s in gathered if s.startswith(("f32[4,2,64,160]", "f32[4,160,64]"))], "expert weights gathered"
    assert [name for _, name in collectives(hlo, exchange) if "shard_map" in name], f"no {exchange} of the experts"
