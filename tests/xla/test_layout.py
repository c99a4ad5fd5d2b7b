"""The xla backend's placement rules (backends/xla/layout.py) as data: which mesh axes each dimension of a
parameter, a batch and an activation is split over. Plain Python, no torch_xla: milliseconds."""
import pytest

from portable_fsdp.backends.xla import layout
from portable_fsdp.errors import UserError
from portable_fsdp.plan import MeshSpec

LLAMA_TP_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                 "layers.*.mlp.down_proj": "rowwise"}
MIXTRAL_TP_PLAN = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
                   "layers.*.mlp.experts": "moe_tp_experts"}
SHARD = ("fsdp", "ep", "cp", "sp", "tp")  # every device of one replica
NOT_TP = ("fsdp", "ep", "cp", "sp")


def test_the_mesh_orders_the_plans_axes_outermost_first_with_ep_inside_fsdp():
    spec = MeshSpec(dp_replicate_size=2, fsdp_size=4, ep_size=2, tp_size=2).resolve(16)
    assert dict(zip(layout.MESH_AXES, layout.mesh_shape(spec))) == {
        "dp_replicate": 2, "fsdp": 2, "ep": 2, "cp": 1, "sp": 1, "tp": 2}
    assert layout.mesh_shape(MeshSpec().resolve(4)) == (1, 4, 1, 1, 1, 1)


def test_a_plain_parameter_is_split_over_every_device_of_a_replica_on_its_largest_dimension():
    assert layout.parameter_spec((384, 64)) == (SHARD, None)
    assert layout.parameter_spec((64, 160)) == (None, SHARD)
    assert layout.parameter_spec((64, 64)) == (SHARD, None)  # the first of equals, as FSDPv2 picks
    assert layout.parameter_spec((64,)) == (SHARD,)
    assert layout.parameter_spec(()) == ()


@pytest.mark.parametrize("style,ndim,transposed,dim", [
    ("colwise", 2, False, 0), ("rowwise", 2, False, 1),  # nn.Linear [out, in]
    ("colwise", 1, False, 0), ("rowwise", 1, False, None),  # biases: split with the outputs, whole for rowwise
    ("colwise", 2, True, 1), ("rowwise", 2, True, 0),  # Conv1D [in, out]
    ("packed_colwise", 3, False, 1), ("rowwise", 3, False, 2),  # fused experts [experts, out, in]
    ("replicated_with_grad_allreduce", 2, False, None), ("moe_tp_experts", 3, False, None), (None, 2, False, None),
])
def test_tensor_parallel_styles_pick_the_output_or_input_features(style, ndim, transposed, dim):
    assert layout.tp_dim(style, ndim, transposed) == dim


def test_a_tensor_parallel_weight_is_split_two_ways():
    assert layout.parameter_spec((64, 64), tp_dim=0) == ("tp", NOT_TP)  # colwise: out over tp, in over fsdp
    assert layout.parameter_spec((64, 160), tp_dim=1) == (NOT_TP, "tp")  # rowwise
    assert layout.parameter_spec((64,), tp_dim=0) == (("tp", *NOT_TP),)  # colwise bias: tp-major


def test_an_expert_weight_has_its_experts_over_ep():
    assert layout.parameter_spec((4, 320, 64), expert=True) == ("ep", ("fsdp", "cp", "sp", "tp"), None)
    assert layout.parameter_spec((4, 64, 160), expert=True) == ("ep", None, ("fsdp", "cp", "sp", "tp"))
    # With tensor parallelism too: the packed gate/up outputs over tp, the hidden dimension over the rest.
    assert layout.parameter_spec((4, 320, 64), tp_dim=1, expert=True) == ("ep", "tp", ("fsdp", "cp", "sp"))


def test_plan_keys_match_layer_indices_at_a_dot():
    assert layout.tp_style(LLAMA_TP_PLAN, "model.layers.11.self_attn.q_proj.weight") == "colwise"
    assert layout.tp_style(LLAMA_TP_PLAN, "model.layers.0.self_attn.o_proj.bias") == "rowwise"
    assert layout.tp_style(LLAMA_TP_PLAN, "model.layers.0.self_attn.k_proj.weight") is None
    assert layout.tp_style(LLAMA_TP_PLAN, "model.layers.x.self_attn.q_proj.weight") is None
    assert layout.tp_style({"q_proj": "colwise"}, "model.layers.0.self_attn.xq_proj.weight") is None
    # A key naming the parameter itself wins over one naming its module.
    assert layout.tp_style(MIXTRAL_TP_PLAN, "model.layers.1.mlp.experts.gate_up_proj") == "packed_colwise"
    assert layout.tp_modules(MIXTRAL_TP_PLAN, ["model.layers.1.mlp", "model.layers.1.mlp.experts"]) == {
        "model.layers.1.mlp.experts": "moe_tp_experts"}


def test_expert_weights_are_the_fused_tensors_of_an_experts_module():
    assert layout.is_expert_weight("model.layers.0.mlp.experts.gate_up_proj", (4, 320, 64), 4)
    assert not layout.is_expert_weight("model.layers.0.mlp.gate.weight", (4, 64), 4)  # the router
    assert not layout.is_expert_weight("model.layers.0.mlp.experts.gate_up_proj", (4, 320, 64), 0)  # no ep
    assert not layout.is_expert_weight("model.layers.0.mlp.experts.gate_up_proj", (8, 320, 64), 4)


def test_batches_and_activations_split_rows_over_data_parallel_ranks_and_positions_over_cp_or_sp():
    assert layout.activation_spec(2) == (("dp_replicate", "fsdp", "ep"), ("cp", "sp"))
    assert layout.tp_output_spec(3, "colwise") == (layout.ROWS, layout.POSITIONS, "tp")
    assert layout.tp_output_spec(3, "rowwise") == (layout.ROWS, layout.POSITIONS, None)
    assert layout.tp_output_spec(2, "colwise") is None  # [tokens, features] inside a MoE layer: not annotated
    assert layout.head_sharded_spec(4, 1) == (layout.ROWS, ("tp", "sp"), None, None)  # q/k/v [b, h, s, d]
    assert layout.head_sharded_spec(4, 2) == (layout.ROWS, None, ("tp", "sp"), None)  # output [b, s, h, d]


def meta_model(family: str):
    """The tiny model of `family` (tests/parity/families.py) on the meta device: names and shapes only."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.parity.families import hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(family))


def test_every_weight_of_a_tensor_parallel_qwen2_follows_its_plan():
    model = meta_model("qwen2")
    specs = layout.parameter_specs(model, model.config.base_model_tp_plan, 0)
    layer = {name.split("layers.0.", 1)[1]: spec for name, spec in specs.items() if "layers.0." in name}
    assert layer == {
        "self_attn.q_proj.weight": ("tp", NOT_TP), "self_attn.q_proj.bias": (("tp", *NOT_TP),),
        "self_attn.k_proj.weight": ("tp", NOT_TP), "self_attn.k_proj.bias": (("tp", *NOT_TP),),
        "self_attn.v_proj.weight": ("tp", NOT_TP), "self_attn.v_proj.bias": (("tp", *NOT_TP),),
        "self_attn.o_proj.weight": (NOT_TP, "tp"), "mlp.gate_proj.weight": ("tp", NOT_TP),
        "mlp.up_proj.weight": ("tp", NOT_TP), "mlp.down_proj.weight": (NOT_TP, "tp"),
        "input_layernorm.weight": (SHARD,), "post_attention_layernorm.weight": (SHARD,)}
    assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == (SHARD, None)  # not in the plan


def test_mixtral_experts_go_over_ep_and_the_router_does_not():
    specs = layout.parameter_specs(meta_model("mixtral"), {}, 4)
    assert specs["model.layers.1.mlp.experts.gate_up_proj"] == ("ep", ("fsdp", "cp", "sp", "tp"), None)
    assert specs["model.layers.1.mlp.experts.down_proj"] == ("ep", None, ("fsdp", "cp", "sp", "tp"))
    assert specs["model.layers.1.mlp.gate.weight"] == (None, SHARD)  # [experts, hidden]: a plain weight
    # Without expert parallelism the experts are plain weights too (their largest dimension).
    assert layout.parameter_specs(meta_model("mixtral"), {}, 0)["model.layers.1.mlp.experts.gate_up_proj"] == (
        None, SHARD, None)


def test_a_plan_that_splits_nothing_is_an_error_not_plain_fsdp():
    with pytest.raises(UserError, match="plan.tp_plan: names no weight of the model .*model.embed_tokens.weight"):
        layout.parameter_specs(meta_model("llama"), {"layers.*.attn.c_attn": "colwise"}, 0)
    with pytest.raises(UserError, match="plan.ep_size: found no fused expert weights"):
        layout.parameter_specs(meta_model("llama"), {}, 4)
