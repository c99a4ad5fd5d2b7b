"""Model families under tensor and Ulysses sequence parallelism on --backend cpu (2 gloo ranks), against the
single-process plain-torch run of the same model (tests/parity/families.py): Qwen2's q/k/v biases split with
their heads, Mistral's sliding window (32 < 64 tokens) in the whole-sequence Ulysses mask, Mixtral's experts kept
whole on every tp rank while its attention is split, GPT-2 (its own attention module) under Ulysses."""
import pytest

from tests.parity import families

TP2 = {"plan.tp_size": 2}
SP2 = {"plan.sp_size": 2}
CASES = [("qwen2", TP2), ("qwen2", SP2), ("mistral", SP2), ("mistral", TP2), ("mixtral", TP2), ("gpt2", SP2)]


@pytest.mark.slow
@pytest.mark.parametrize("family, plan", CASES, ids=[f"{f}-{next(iter(p))[5:]}" for f, p in CASES])
def test_family_trains_like_plain_torch_under_tp_and_sp(family, plan, tmp_path, tmp_path_factory):
    families.assert_trains_like_plain_torch("cpu", families.saved(tmp_path_factory, family), tmp_path, plan=plan)
