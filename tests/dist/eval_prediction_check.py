"""Run under torchrun (gloo): evaluate at init with Hugging Face Trainer's compute_metrics(EvalPrediction) — on
the full logits, and on what preprocess_logits_for_metrics keeps of each batch — for each named mesh, and write
rank 0's metrics, and the shapes the preprocess function was handed, to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/eval_prediction_check.py OUT.json \
        NAME=JSON_OVERRIDES...
"""
import json
import os
import sys

import numpy as np

from portable_fsdp import backends
from portable_fsdp.config.validate import resolve_plan
from portable_fsdp.data.batch import IGNORE_INDEX, EvalBatches
from portable_fsdp.data.loader import build_token_data
from portable_fsdp.training.evaluation import evaluate
from tests.dist.fsdp_variants import EVAL_SEQUENCES
from tests.parity.matrix import make_config
from tests.dist.launch import write_results

SEEN = []  # (rows, seq_len) of every logits tensor preprocess_logits was handed


def preprocess_logits_for_metrics(logits, labels):
    """As transformers' examples/pytorch/language-modeling/run_clm.py writes it."""
    SEEN.append(list(logits.shape[:2]))
    assert labels.shape == logits.shape[:2]
    return logits.argmax(dim=-1)


def accuracy(eval_pred):
    """run_clm.py's compute_metrics: labels are the inputs, shifted here."""
    predictions, labels = eval_pred
    predictions, labels = predictions[:, :-1], labels[:, 1:]
    mask = labels != IGNORE_INDEX
    return {"accuracy": float((predictions[mask] == labels[mask]).mean()), "rows": len(labels)}


def label_nll(eval_pred):
    """From the full logits: the mean negative log-probability of the label tokens, and the logits' shape."""
    logits, labels = eval_pred.predictions[:, :-1].astype(np.float64), eval_pred.label_ids[:, 1:]
    mask = labels != IGNORE_INDEX
    peak = logits.max(-1, keepdims=True)
    log_probs = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, np.where(mask, labels, 0)[..., None], -1)[..., 0]
    argmax_accuracy = float((logits.argmax(-1)[mask] == labels[mask]).mean())
    return {"nll": float(-picked[mask].mean()), "shape": list(eval_pred.predictions.shape),
            "argmax_accuracy": argmax_accuracy}


def run(backend, overrides: dict) -> dict:
    config = make_config(overrides)
    state = backend.init(config, resolve_plan(config, int(os.environ["WORLD_SIZE"])), "cpu")
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    evals = EvalBatches(data.eval[:EVAL_SEQUENCES], config.train.eval_batch_size, where.dp_rank, where.dp_size)
    SEEN.clear()
    preprocessed = evaluate(backend, state, evals, compute_metrics=accuracy,
                            preprocess_logits=preprocess_logits_for_metrics)
    full = evaluate(backend, state, evals, compute_metrics=label_nll)
    return {"preprocessed": preprocessed, "full": full, "seen": list(SEEN)}


def main() -> None:
    out, runs = sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])
    backend = backends.load("cpu")
    results = {name: run(backend, json.loads(overrides)) for name, overrides in runs.items()}
    write_results(out, results)
    backend.finalize()


if __name__ == "__main__":
    main()
