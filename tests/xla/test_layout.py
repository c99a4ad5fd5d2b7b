"""The xla backend's placement rules (portable_fsdp/backends/xla/layout.py) as data: which mesh axes each dimension of a
parameter, a batch and an activation is split over. Plain Python, no torch_xla: milliseconds."""
import pytest

from portable_fsdp import placement
from portable_fsdp.backends.xla import layout
from portable_fsdp.errors import UserError
from portable_fsdp.plan import MeshSpec

SHARD = ("fsdp", "ep", "cp", "sp", "tp")  # every device of one replica
NOT_TP = ("fsdp", "ep", "cp", "sp")
SIZES = {"dp_replicate": 1, "fsdp": 2, "ep": 1, "cp": 1, "sp": 1, "tp": 2}  # SHARD: 4 devices, NOT_TP: 2


def test_the_mesh_orders_the_plans_axes_outermost_first_with_ep_inside_fsdp():
    spec = MeshSpec(dp_replicate_size=2, fsdp_size=4, ep_size=4, tp_size=2).resolve(16)
    assert dict(zip(placement.MESH_AXES, layout.mesh_shape(spec))) == {
        "dp_replicate": 2, "fsdp": 2, "ep": 2, "cp": 1, "sp": 1, "tp": 2}
    assert layout.mesh_shape(MeshSpec().resolve(4)) == (1, 4, 1, 1, 1, 1)


def test_a_plain_parameter_is_split_over_every_device_of_a_replica_on_its_largest_dimension():
    assert layout.parameter_spec((384, 64), SIZES) == (SHARD, None)
    assert layout.parameter_spec((64, 160), SIZES) == (None, SHARD)
    assert layout.parameter_spec((64, 64), SIZES) == (SHARD, None)  # the first of equals
    assert layout.parameter_spec((66, 64), SIZES) == (None, SHARD)  # the largest the 4 devices divide
    assert layout.parameter_spec((66, 63), SIZES) == (None, None)  # none: whole
    assert layout.parameter_spec((64,), SIZES) == (None,)  # small (a norm scale): whole
    assert layout.parameter_spec((), SIZES) == ()


def test_a_tensor_parallel_weight_is_split_two_ways():
    assert layout.parameter_spec((64, 64), SIZES, tp_dim=0) == ("tp", NOT_TP)  # colwise: out over tp, in over fsdp
    assert layout.parameter_spec((64, 160), SIZES, tp_dim=1) == (NOT_TP, "tp")  # rowwise
    assert layout.parameter_spec((64,), SIZES, tp_dim=0) == ("tp",)  # colwise bias: small, over tp alone


def test_an_expert_weight_has_its_experts_over_ep_and_tp():
    sizes = {**SIZES, "ep": 2, "tp": 1}
    assert layout.parameter_spec((4, 320, 64), sizes, expert=True) == (("ep", "tp"), ("fsdp", "cp", "sp"), None)
    assert layout.parameter_spec((4, 64, 160), sizes, expert=True) == (("ep", "tp"), None, ("fsdp", "cp", "sp"))


def test_batches_and_activations_split_rows_over_data_parallel_ranks_and_positions_over_cp_or_sp():
    rows, positions = ("dp_replicate", "fsdp", "ep"), ("cp", "sp")
    assert layout.activation_spec(2) == (rows, positions)
    assert layout.tp_output_spec(3, "colwise") == (rows, positions, "tp")
    assert layout.tp_output_spec(3, "rowwise") == (rows, positions, None)
    assert layout.tp_output_spec(2, "colwise") is None  # [tokens, features] inside a MoE layer: not annotated
    assert layout.head_sharded_spec(4, 1) == (rows, ("tp", "sp"), None, None)  # q/k/v [b, h, s, d]
    assert layout.head_sharded_spec(4, 2) == (rows, None, ("tp", "sp"), None)  # output [b, s, h, d]


def meta_model(family: str):
    """The tiny model of `family` (tests/parity/families.py) on the meta device: names and shapes only."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.parity.families import hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(family))


FSDP2_TP2 = MeshSpec(fsdp_size=2, tp_size=2).resolve(4)
FSDP4_EP2 = MeshSpec(fsdp_size=4, ep_size=2).resolve(4)
FSDP2_TP2_EP4 = MeshSpec(fsdp_size=2, tp_size=2, ep_size=4).resolve(4)


def test_every_weight_of_a_tensor_parallel_qwen2_follows_its_plan():
    model = meta_model("qwen2")
    specs = layout.parameter_specs(model, model.config.base_model_tp_plan, 0, FSDP2_TP2)
    layer = {name.split("layers.0.", 1)[1]: spec for name, spec in specs.items() if "layers.0." in name}
    assert layer == {
        "self_attn.q_proj.weight": ("tp", NOT_TP), "self_attn.q_proj.bias": ("tp",),
        "self_attn.k_proj.weight": ("tp", NOT_TP), "self_attn.k_proj.bias": ("tp",),
        "self_attn.v_proj.weight": ("tp", NOT_TP), "self_attn.v_proj.bias": ("tp",),
        "self_attn.o_proj.weight": (NOT_TP, "tp"), "mlp.gate_proj.weight": ("tp", NOT_TP),
        "mlp.up_proj.weight": ("tp", NOT_TP), "mlp.down_proj.weight": (NOT_TP, "tp"),
        "input_layernorm.weight": (None,), "post_attention_layernorm.weight": (None,)}  # norms: small, whole
    assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == (SHARD, None)  # not in the plan


def test_a_rowwise_embedding_is_split_by_vocabulary():
    """An embedding is [vocab, hidden]: its input features are the vocabulary, as torch's RowwiseParallel splits it."""
    specs = layout.parameter_specs(meta_model("llama"), {"embed_tokens": "rowwise"}, 0, FSDP2_TP2)
    assert specs["model.embed_tokens.weight"] == ("tp", NOT_TP)


def test_mixtral_experts_go_over_ep_and_the_router_does_not():
    specs = layout.parameter_specs(meta_model("mixtral"), {}, 4, FSDP4_EP2)
    assert specs["model.layers.1.mlp.experts.gate_up_proj"] == (("ep", "tp"), ("fsdp", "cp", "sp"), None)
    assert specs["model.layers.1.mlp.experts.down_proj"] == (("ep", "tp"), None, ("fsdp", "cp", "sp"))
    assert specs["model.layers.1.mlp.gate.weight"] == (None, None)  # [experts, hidden]: a small plain weight
    # Without expert parallelism the experts are plain weights too (their largest dimension).
    assert layout.parameter_specs(meta_model("mixtral"), {}, 0, FSDP4_EP2)[
        "model.layers.1.mlp.experts.gate_up_proj"] == (None, SHARD, None)


def test_mixtral_experts_are_not_cut_by_tp():
    """Without expert parallelism, FSDPv2 stores them over every device as a plain weight; with it, their experts
    go over ep × tp (ep 4 = fsdp 2 × tp 2: the expert mesh axis ep is the 2 fsdp ranks of the ep group)."""
    model = meta_model("mixtral")
    specs = layout.parameter_specs(model, model.config.base_model_tp_plan, 0, FSDP2_TP2)
    assert specs["model.layers.1.mlp.experts.gate_up_proj"] == (None, SHARD, None)
    assert specs["model.layers.1.self_attn.q_proj.weight"] == ("tp", NOT_TP)
    specs = layout.parameter_specs(model, model.config.base_model_tp_plan, 4, FSDP2_TP2_EP4)
    assert specs["model.layers.1.mlp.experts.gate_up_proj"] == (("ep", "tp"), ("fsdp", "cp", "sp"), None)
    assert specs["model.layers.1.self_attn.q_proj.weight"] == ("tp", NOT_TP)


def test_a_plan_that_splits_nothing_is_an_error_not_plain_fsdp():
    with pytest.raises(UserError, match="plan.tp_plan: names no weight of the model .*model.embed_tokens.weight"):
        layout.parameter_specs(meta_model("llama"), {"layers.*.attn.c_attn": "colwise"}, 0, FSDP2_TP2)
    with pytest.raises(UserError, match="plan.ep_size: found no fused expert weights"):
        layout.parameter_specs(meta_model("llama"), {}, 4, FSDP4_EP2)


def test_expert_parallelism_needs_batches_whose_tokens_split_over_the_devices():
    """Every device dispatches its share of a batch's tokens; checked for the run's micro-batches and eval batches
    before any worker starts, each error naming the field that sets the batch's rows."""
    import ml_collections

    config = ml_collections.ConfigDict({"train": {"batch_size": 4, "grad_accum_steps": 2, "eval_batch_size": 3},
                                        "data": {"seq_len": 5}})
    with pytest.raises(UserError) as error:
        layout.check_expert_batches(config, 4)  # 2 rows x 5 positions
    assert error.value.field == "plan.ep_size" and "\n" not in str(error.value)
    assert "10 tokens" in str(error.value)
    assert "make train.batch_size / train.grad_accum_steps x data.seq_len a multiple of 4" in str(error.value)
    config.data.seq_len = 8
    with pytest.raises(UserError) as error:
        layout.check_expert_batches(config, 16)  # train: 16 tokens; eval: 3 rows x 8
    assert "24 tokens" in str(error.value) and "make train.eval_batch_size x data.seq_len" in str(error.value)
    layout.check_expert_batches(config, 8)
