"""FSDP v1 (XlaFullyShardedDataParallel, plan.xla_fsdp_v2=false) on one PJRT CPU device against the
single-process torch reference. One device only: multi-process PJRT CPU collectives abort in torch_xla 2.9
(the multi-process path is the TPU one, see test_tpu.py)."""
import pytest

from tests.parity.matrix import make_config, variants_for
from tests.parity.reference import max_relative_difference, reference_losses
from tests.xla.helpers import variants

STEPS = 20
FP32_RTOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return reference_losses(make_config({}), STEPS)


@pytest.fixture(scope="module")
def v1(tmp_path_factory):
    return variants(tmp_path_factory.mktemp("v1"), 1, STEPS, ["v1"])["v1"]


def test_v1_losses_match_single_process_reference(v1, reference):
    assert max_relative_difference(v1["losses"], reference) <= FP32_RTOL


def test_v1_weight_decay_follows_the_original_shapes(v1, reference):
    """v1 hands AdamW flat 1-D shards: decaying none of them (or all) would drift from the reference by
    ~5e-4 within 20 steps, far outside the tolerance above; the names map back to the model's."""
    assert "model.layers.0.self_attn.q_proj.weight" in v1["names"] and "model.norm.weight" in v1["names"]
    assert len(v1["names"]) == 21


def test_v1_compiles_nothing_after_warmup(v1):
    compiles = v1["compiles"][1:]
    assert len(set(compiles)) == 1, compiles


@pytest.mark.slow
@pytest.mark.parametrize("name", variants_for("xla", slow=True, world=1))
def test_v1_variants_match_reference(tmp_path, reference, name):
    result = variants(tmp_path, 1, STEPS, [name])[name]
    assert max_relative_difference(result["losses"], reference) <= FP32_RTOL
