"""The shared evaluation layer, the same for every backend.

eval_loss = Σ token losses over every rank / Σ label tokens, divided once. The label tokens of each
batch (num_items_in_batch) are counted by `backend.count_label_tokens` on the batch as the loader gave
it — before context parallelism shards it — so eval_loss under CP equals eval_loss without CP.

Overriding the evaluation step: pass `eval_step=fn` with
    fn(state, batch, num_items_in_batch) -> {"loss_sum": Σ token losses of the batch over all ranks, ...}
`num_items_in_batch` arrives already counted (global, before sharding); don't count after sharding.
`compute_metrics(predictions, labels) -> dict` receives full-length predictions of every eval row in the
original token order (gathered by `backend.predict_step`, padding rows dropped).
"""
from __future__ import annotations

import importlib
import math

import numpy as np

from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.errors import UserError


def evaluate(backend, state, batches, eval_step=None, compute_metrics=None) -> dict:
    step = eval_step or backend.eval_step
    loss_sum, tokens = 0.0, 0
    predictions, labels = [], []
    for batch in batches:
        num_items_in_batch = backend.count_label_tokens(state, batch)
        loss_sum += step(state, batch, num_items_in_batch)["loss_sum"]
        tokens += num_items_in_batch
        if compute_metrics is not None:
            out = backend.predict_step(state, batch)
            predictions.append(out["predictions"])
            labels.append(out["labels"])
    if tokens == 0:
        raise UserError("data.eval_fraction", "the eval split has no label tokens; give it more text "
                        "(a larger data.eval_fraction or more data)")
    eval_loss = loss_sum / tokens
    result = {"eval_loss": eval_loss, "eval_tokens": tokens, "perplexity": math.exp(min(eval_loss, 50.0))}
    if compute_metrics is not None:
        predictions, labels = np.concatenate(predictions), np.concatenate(labels)
        real = (labels != IGNORE_INDEX).any(axis=1)  # drop the rows that only pad the last batch
        result.update({f"eval_{k}": v for k, v in compute_metrics(predictions[real], labels[real]).items()})
    return result


def token_accuracy(predictions: np.ndarray, labels: np.ndarray) -> dict:
    """Fraction of label tokens whose argmax prediction is right."""
    mask = labels != IGNORE_INDEX
    return {"token_accuracy": float((predictions[mask] == labels[mask]).mean())}


BUILTIN_METRICS = {"token_accuracy": token_accuracy}


def resolve_metrics(spec: str):
    """`train.compute_metrics`: "" (none), a built-in name, or "package.module:function"."""
    if not spec:
        return None
    if spec in BUILTIN_METRICS:
        return BUILTIN_METRICS[spec]
    module_name, _, function = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError):
        raise UserError("train.compute_metrics", (
            f"cannot import {spec!r}; use one of {', '.join(BUILTIN_METRICS)} or 'package.module:function'")) from None
