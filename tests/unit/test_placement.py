"""The placement rules every backend asks (portable_fsdp/placement.py): the mesh axes, the tensor-parallel plan's
keys as transformers matches them, the dimension each style splits, and FSDP's largest free dimension. That the
three backends place each family's parameters alike: tests/parity/test_placement_across_backends.py."""
import pytest

from portable_fsdp import placement
from portable_fsdp.plan import MeshSpec
from tests.unit._helpers import user_error

LLAMA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.mlp.down_proj": "rowwise", "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}
MIXTRAL_PLAN = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
                "layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.gate_proj": "colwise"}


def test_the_axes_are_ordered_as_meshspec_orders_ranks_with_ep_inside_fsdp():
    # ep 4 with tp 2: an ep group spans 2 of the 4 fsdp ranks and their tp ranks
    sizes = placement.axis_sizes(MeshSpec(dp_replicate_size=2, fsdp_size=4, ep_size=4, tp_size=2).resolve(16))
    assert sizes == {"dp_replicate": 2, "fsdp": 2, "ep": 2, "cp": 1, "sp": 1, "tp": 2}
    assert tuple(sizes) == placement.MESH_AXES
    # ep = tp: the ep group is the tp group, no fsdp rank taken
    sizes = placement.axis_sizes(MeshSpec(fsdp_size=4, ep_size=2, tp_size=2).resolve(8))
    assert sizes == {"dp_replicate": 1, "fsdp": 4, "ep": 1, "cp": 1, "sp": 1, "tp": 2}
    assert placement.DATA_AXES + placement.SEQUENCE_AXES + ("tp",) == placement.MESH_AXES


def test_experts_split_over_ep_and_tp_only_under_expert_parallelism():
    assert placement.expert_axes(MeshSpec(ep_size=2, tp_size=2).resolve(2)) == ("ep", "tp")
    assert placement.expert_axes(MeshSpec(tp_size=2).resolve(2)) == ()


@pytest.mark.parametrize("name, generic", [
    ("layers.11.self_attn.q_proj", "layers.*.self_attn.q_proj"), ("h.0.mlp.w1", "h.*.mlp.w1"),  # w1: not an index
    ("blocks.0.1.attn", "blocks.*.*.attn"), ("embed_tokens", "embed_tokens")])
def test_layer_indices_become_a_star(name, generic):
    assert placement.generic_name(name) == generic


def test_a_key_names_a_whole_module_or_parameter_with_star_for_one_index():
    assert placement.key_style(LLAMA_PLAN, "layers.11.self_attn.q_proj") == "colwise"
    assert placement.key_style(LLAMA_PLAN, "layers.x.self_attn.q_proj") is None  # `*` is an index, not any text
    assert placement.key_style(LLAMA_PLAN, "model.layers.0.self_attn.q_proj") is None  # relative to the base model
    assert placement.key_style(LLAMA_PLAN, "layers.0.self_attn.q_proj_extra") is None
    assert placement.key_style({"layers.*.self_attn.*_proj": "colwise"}, "layers.0.self_attn.q_proj") is None
    # A key naming the parameter itself wins over one naming its module (transformers' rule).
    assert placement.parameter_style(MIXTRAL_PLAN, "layers.1.mlp.experts.gate_up_proj") == "packed_colwise"
    assert placement.parameter_style(LLAMA_PLAN, "layers.1.self_attn.q_proj.bias") == "colwise"


@pytest.mark.parametrize("parameter, ndim, in_out, dim", [
    ("layers.0.self_attn.q_proj.weight", 2, False, 0), ("layers.0.self_attn.o_proj.weight", 2, False, 1),  # [out, in]
    ("layers.0.self_attn.q_proj.bias", 1, False, 0), ("layers.0.self_attn.o_proj.bias", 1, False, None),  # biases
    ("layers.0.self_attn.q_proj.kernel", 2, True, 1), ("layers.0.self_attn.o_proj.kernel", 2, True, 0),  # [in, out]
    ("layers.0.self_attn.q_norm.weight", 1, False, None),  # replicated_with_grad_allreduce: whole
    ("layers.0.mlp.up_proj.weight", 2, False, None),  # not in the plan
])
def test_colwise_splits_the_output_features_and_rowwise_the_input_features(parameter, ndim, in_out, dim):
    assert placement.tp_dim(LLAMA_PLAN, parameter, ndim, in_out) == dim


def test_an_embedding_is_split_like_an_in_out_weight():
    """[vocab, hidden]: rowwise splits the vocabulary and colwise the hidden features, as torch's styles do."""
    assert placement.tp_dim({"embed_tokens": "rowwise"}, "embed_tokens.weight", 2, in_out=True) == 0
    assert placement.tp_dim({"embed_tokens": "colwise"}, "embed_tokens.weight", 2, in_out=True) == 1


def test_a_moe_layers_experts_stay_whole_over_tp():
    for name in ("layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"):
        assert placement.in_experts(MIXTRAL_PLAN, name)
        assert placement.tp_dim(MIXTRAL_PLAN, name, 3) is None
    assert not placement.in_experts(MIXTRAL_PLAN, "layers.0.mlp.gate.weight")
    assert placement.tp_dim(MIXTRAL_PLAN, "layers.0.mlp.gate_proj.weight", 2) == 0  # a dense layer's MLP
    assert placement.tp_modules(MIXTRAL_PLAN, ["layers.1.mlp", "layers.1.mlp.experts", "layers.1.mlp.gate_proj"]) \
        == {"layers.1.mlp.gate_proj": "colwise"}


def test_keys_that_name_nothing_and_split_keys_on_parameters():
    names = ["layers.0.self_attn.q_proj", "layers.0.self_attn.q_proj.weight"]
    assert placement.unmatched_keys({"layers.*.self_attn.q_proj": "colwise", "layers.*.attn.c_attn": "colwise"},
                                    names) == ["layers.*.attn.c_attn"]
    placement.check_parameter_keys(MIXTRAL_PLAN, ["layers.0.mlp.experts.down_proj"])  # an expert tensor: whole
    with user_error("plan.tp_plan", "'layers.*.mlp.up_proj.weight' names a parameter, and colwise and rowwise "
                                    "split whole layers; name its module, 'layers.*.mlp.up_proj'"):
        placement.check_parameter_keys({"layers.*.mlp.up_proj.weight": "colwise"}, ["layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("shape, shard_size, taken, dim", [
    ((384, 64), 2, (), 0), ((64, 160), 2, (), 1),  # the largest dimension
    ((64, 64), 2, (), 0),  # the first of equals
    ((96, 64), 64, (), 1),  # the largest the devices divide
    ((97, 33), 2, (), None),  # none divisible: whole
    ((64, 160), 2, (1,), 0),  # a dimension tp or ep took is not free
    ((64, 160), 2, (0, 1), None),
    ((1024,), 2, (), 0), ((1023,), 1, (), None),  # MIN_SHARDED_ELEMENTS: at least, not under
    ((4, 16, 16), 4, (0,), 1),  # a tensor's elements count, not one dimension's
    ((), 2, (), None),
])
def test_fsdp_splits_the_largest_free_dimension_it_divides(shape, shard_size, taken, dim):
    assert placement.fsdp_dim(shape, shard_size, taken) == dim
