"""What must divide what in the mesh, checked at start-up against the model's own sizes (mesh_fit.py)."""
import dataclasses

import pytest

from portable_fsdp.backend import ModelInfo
from portable_fsdp.mesh_fit import check_mesh_fits, largest_divisor, tensor_parallel_plan
from portable_fsdp.plan import MeshSpec, ShardingPlan
from tests.unit._helpers import user_error

LLAMA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
LLAMA = ModelInfo(class_names=(), no_split_modules=(), n_params=1, n_layers=2, hidden_size=64, vocab_size=384,
                  root_class="LlamaForCausalLM", num_attention_heads=8, num_key_value_heads=2, tp_plan=LLAMA_PLAN)
MIXTRAL = dataclasses.replace(LLAMA, root_class="MixtralForCausalLM", num_experts=6)
GPT2 = dataclasses.replace(LLAMA, root_class="GPT2LMHeadModel", num_key_value_heads=8, tp_plan={})


def plan(world: int, **sizes) -> ShardingPlan:
    extra = {"tp_plan": sizes.pop("tp_plan")} if "tp_plan" in sizes else {}
    return ShardingPlan(mesh=MeshSpec(**sizes).resolve(world), **extra)


@pytest.mark.parametrize("n, at_most, expected", [(8, 3, 2), (6, 4, 3), (7, 4, 1), (4, 8, 4)])
def test_largest_divisor(n, at_most, expected):
    assert largest_divisor(n, at_most) == expected


@pytest.mark.parametrize("model, world, sizes", [
    (LLAMA, 4, {"tp_size": 2}), (LLAMA, 4, {"sp_size": 2}), (LLAMA, 4, {"tp_size": 2, "sp_size": 2}),
    (MIXTRAL, 4, {"ep_size": 2}), (MIXTRAL, 3, {"ep_size": 3}), (LLAMA, 4, {"dp_replicate_size": 2}),
    (MIXTRAL, 4, {"ep_size": 2, "tp_size": 2}), (MIXTRAL, 6, {"ep_size": 6, "tp_size": 2}),
])
def test_meshes_that_fit(model, world, sizes):
    check_mesh_fits(plan(world, **sizes), model)


@pytest.mark.parametrize("field, sizes, phrase", [
    ("plan.tp_size", {"tp_size": 4}, "the model's 2 key/value heads are not divisible by tp_size=4 (tensor "
                                     "parallelism splits heads over tp ranks); use e.g. plan.tp_size=2"),
    ("plan.sp_size", {"sp_size": 4}, "2 key/value heads are not divisible by sp_size=4"),
])
def test_heads_must_divide(field, sizes, phrase):
    with user_error(field, phrase):
        check_mesh_fits(plan(4, **sizes), LLAMA)


def test_sp_divides_the_heads_each_tp_rank_holds():
    check_mesh_fits(plan(8, tp_size=2, sp_size=4), dataclasses.replace(LLAMA, num_key_value_heads=8))  # 4 per tp rank
    model = dataclasses.replace(LLAMA, num_attention_heads=4, num_key_value_heads=4)  # 4 divides by 2 and by 4 alone
    with user_error("plan.sp_size", "the model's 4 attention heads leave 2 per tp rank (tp_size=2), which sp_size=4 "
                                    "does not divide") as info:
        check_mesh_fits(plan(8, tp_size=2, sp_size=4), model)
    assert "plan.sp_size=2" in info.value.message


def test_attention_heads_are_checked_before_kv_heads():
    model = dataclasses.replace(LLAMA, num_attention_heads=6, num_key_value_heads=6)
    with user_error("plan.tp_size", "the model's 6 attention heads are not divisible by tp_size=4") as info:
        check_mesh_fits(plan(4, tp_size=4), model)
    assert "plan.tp_size=3" in info.value.message


def test_ep_on_a_dense_model():
    with user_error("plan.ep_size", "2 needs a mixture-of-experts model; LlamaForCausalLM is dense"):
        check_mesh_fits(plan(4, ep_size=2), LLAMA)


def test_experts_must_divide_over_ep():
    # 3 would split the 6 experts but not the 4 fsdp ranks the ep ranks are taken from
    with user_error("plan.ep_size", "6 experts per layer do not split over 4 ranks; use e.g. plan.ep_size=2"):
        check_mesh_fits(plan(4, ep_size=4), MIXTRAL)
    with user_error("plan.ep_size", "6 experts per layer do not split over 4 ranks; use e.g. plan.ep_size=3"):
        check_mesh_fits(plan(12, ep_size=4), MIXTRAL)
    # with tp 2 the ep size is a multiple of 2 dividing fsdp × tp = 12: 2 and 6 split the 6 experts, 4 does not
    with user_error("plan.ep_size", "6 experts per layer do not split over 4 ranks; use e.g. plan.ep_size=2"):
        check_mesh_fits(plan(12, ep_size=4, tp_size=2), MIXTRAL)
    with user_error("plan.ep_size", "6 experts per layer do not split over 12 ranks; use e.g. plan.ep_size=6"):
        check_mesh_fits(plan(12, ep_size=12, tp_size=2), MIXTRAL)


def test_tp_on_a_model_without_a_plan_and_none_given():
    with user_error("plan.tp_size", "GPT2LMHeadModel ships none (no base_model_tp_plan in its config): give one as "
                                    "plan.tp_plan"):
        check_mesh_fits(plan(2, tp_size=2), GPT2)
    given = {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}
    check_mesh_fits(plan(2, tp_size=2, tp_plan=given), GPT2)
    assert tensor_parallel_plan(plan(2, tp_size=2, tp_plan=given), GPT2) == given
    assert tensor_parallel_plan(plan(2, tp_size=2), LLAMA) == LLAMA_PLAN


def test_unknown_tp_style():
    with user_error("plan.tp_plan", "unknown style 'sideways'; choose one of colwise, rowwise"):
        check_mesh_fits(plan(2, tp_size=2, tp_plan={"layers.*.mlp.up_proj": "sideways"}), LLAMA)
