"""How the torch lowering overlaps FSDP's all-gathers with compute: decided once, testable without a GPU."""
from portable_fsdp.backends.torch.parallelize import UnitOverlap, explicit_prefetch, unit_overlap
from portable_fsdp.plan import ShardingPlan, WrapPolicy


def test_each_layer_prefetches_its_neighbours_and_the_last_stays_gathered():
    assert unit_overlap(["a", "b", "c"], reshard_after_forward=True, prefetch=True) == [
        UnitOverlap("a", "b", None, True), UnitOverlap("b", "c", "a", True), UnitOverlap("c", None, "b", False)]


def test_without_prefetch_every_unit_keeps_fsdp2s_defaults():
    assert unit_overlap(["a", "b"], reshard_after_forward=True, prefetch=False) == [
        UnitOverlap("a", None, None, True), UnitOverlap("b", None, None, True)]
    assert [u.reshard_after_forward for u in unit_overlap(["a", "b"], False, True)] == [False, False]
    assert unit_overlap(["a"], True, True) == [UnitOverlap("a", None, None, False)]
    assert unit_overlap([], True, True) == []


def test_prefetch_on_cuda_with_transformer_layer_units_only():
    assert explicit_prefetch(ShardingPlan(), "cuda")
    assert not explicit_prefetch(ShardingPlan(), "cpu")  # gloo blocks the CPU that computes: nothing to overlap
    for policy in (WrapPolicy.SIZE_BASED_WRAP, WrapPolicy.NO_WRAP):
        assert not explicit_prefetch(ShardingPlan(auto_wrap_policy=policy), "cuda")
