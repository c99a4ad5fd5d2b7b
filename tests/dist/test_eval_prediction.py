"""Hugging Face Trainer's compute_metrics(EvalPrediction) under context and sequence parallelism on gloo: the same
metrics as one process, from logits gathered to full length and in order, with preprocess_logits_for_metrics
handed each rank's full-length rows."""
import json
import os

import pytest

from tests.dist.fsdp_variants import EVAL_SEQUENCES
from tests.dist.launch import torchrun
from tests.parity.matrix import make_config

HERE = os.path.dirname(__file__)
MESHES = {"cp2": {"plan.cp_size": "2"}, "sp2": {"plan.sp_size": "2"}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_prediction")
    script = os.path.join(HERE, "eval_prediction_check.py")
    torchrun(1, script, str(out / "one.json"), "one={}")
    torchrun(2, script, str(out / "two.json"), *(f"{name}={json.dumps(o)}" for name, o in MESHES.items()))
    return {**json.loads((out / "one.json").read_text()), **json.loads((out / "two.json").read_text())}


@pytest.mark.parametrize("mesh", MESHES)
def test_metrics_equal_one_process(results, mesh):
    one, sharded = results["one"], results[mesh]
    assert sharded["preprocessed"]["eval_rows"] == one["preprocessed"]["eval_rows"] == EVAL_SEQUENCES
    assert sharded["preprocessed"]["eval_accuracy"] == one["preprocessed"]["eval_accuracy"]
    assert sharded["full"]["eval_shape"] == one["full"]["eval_shape"]
    assert sharded["full"]["eval_nll"] == pytest.approx(one["full"]["eval_nll"], rel=1e-5)


@pytest.mark.parametrize("mesh", ["one", *MESHES])
def test_preprocess_sees_full_length_rows_and_matches_full_logits(results, mesh):
    config = make_config({})
    assert {tuple(shape) for shape in results[mesh]["seen"]} == {(config.train.eval_batch_size, config.data.seq_len)}
    assert results[mesh]["preprocessed"]["eval_accuracy"] == results[mesh]["full"]["eval_argmax_accuracy"]
    # Trainer's labels drop one target per row: the mean over the others is near the eval_loss over all
    assert results[mesh]["full"]["eval_nll"] == pytest.approx(results[mesh]["full"]["eval_loss"], rel=0.02)
