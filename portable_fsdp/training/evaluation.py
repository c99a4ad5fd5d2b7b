"""The shared evaluation layer, the same for every backend.

eval_loss = Σ token losses over every rank / Σ label tokens, divided once. The label tokens of each
batch (num_items_in_batch) are counted by `backend.count_label_tokens` on the batch as the loader gave
it — before context parallelism shards it — so eval_loss under CP equals eval_loss without CP.

Overriding the evaluation step: pass `eval_step=fn` with
    fn(state, batch, num_items_in_batch) -> {"loss_sum": Σ token losses of the batch over all ranks, ...}
`num_items_in_batch` arrives already counted (global, before sharding); don't count after sharding. A step that
also returns "count" (a custom loss's Σ count over all ranks: `portable_fsdp.training.parts`) is divided by that
instead.

`compute_metrics` comes in two conventions, told apart by how many arguments it requires:
- `fn(predictions, labels) -> dict`: full-length argmax predictions of every eval row in the original token
  order (gathered by `backend.predict_step`, padding rows dropped), labels aligned with them.
- `fn(eval_prediction) -> dict`, Hugging Face Trainer's: a transformers EvalPrediction whose `.predictions` are
  the logits of every eval row — or, with `preprocess_logits(logits, labels)`, what it returns for each batch,
  on each rank before the rows are gathered (as Trainer calls it) — and whose `.label_ids` are Trainer's labels:
  the inputs' own tokens, unshifted (label_ids[:, t] is what logits[:, t-1] predicts; -100 at position 0).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math

import numpy as np

from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.errors import UserError


def evaluate(backend, state, batches, eval_step=None, compute_metrics=None, preprocess_logits=None) -> dict:
    step = eval_step or backend.eval_step
    trainers = compute_metrics is not None and takes_eval_prediction(compute_metrics)
    loss_sum, tokens = 0.0, 0
    predictions, labels = [], []
    for batch in batches:
        num_items_in_batch = backend.count_label_tokens(state, batch)
        result = step(state, batch, num_items_in_batch)
        loss_sum += result["loss_sum"]
        tokens += result.get("count", num_items_in_batch)
        if trainers:
            out = backend.predict_step(state, dataclasses.replace(batch, labels=trainer_labels(batch.labels)),
                                       return_logits=True, preprocess_logits=preprocess_logits)
            predictions.append(out["logits"])
            labels.append(out["labels"])
        elif compute_metrics is not None:
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
        if trainers:
            from transformers.trainer_utils import EvalPrediction

            metrics = compute_metrics(EvalPrediction(predictions=predictions[real], label_ids=labels[real]))
        else:
            metrics = compute_metrics(predictions[real], labels[real])
        result.update({f"eval_{k}": v for k, v in metrics.items()})
    return result


def trainer_labels(labels: np.ndarray | None) -> np.ndarray | None:
    """Our labels (labels[:, t] is the target of position t) as Trainer's for a causal LM: the inputs' tokens,
    which the model shifts itself (label_ids[:, t + 1] = labels[:, t]). Position 0 is no one's target (-100); the
    last position's target has no place, as in Trainer, where n tokens have n - 1 targets."""
    if labels is None:
        return None
    shifted = np.full_like(labels, IGNORE_INDEX)
    shifted[:, 1:] = labels[:, :-1]
    return shifted


def token_accuracy(predictions: np.ndarray, labels: np.ndarray) -> dict:
    """Fraction of label tokens whose argmax prediction is right."""
    mask = labels != IGNORE_INDEX
    return {"token_accuracy": float((predictions[mask] == labels[mask]).mean())}


BUILTIN_METRICS = {"token_accuracy": token_accuracy}


def takes_eval_prediction(fn) -> bool:
    """Whether `fn` is Trainer's compute_metrics (one required argument: an EvalPrediction) rather than ours
    (two: predictions, labels). Anything else is a UserError: a guess could hand a function the wrong data."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        parameters = None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = None if parameters is None else [
        p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if required is None or any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters) or \
            len(required) not in (1, 2):
        raise UserError("train.compute_metrics", (
            f"cannot tell how to call {getattr(fn, '__name__', fn)!r}: give it one required argument (an "
            "EvalPrediction, as Hugging Face Trainer) or two (predictions, labels)"))
    return len(required) == 1


def resolve_metrics(spec: str):
    """`train.compute_metrics`: "" (none), a built-in name, or "package.module:function"."""
    if not spec:
        return None
    if spec in BUILTIN_METRICS:
        return BUILTIN_METRICS[spec]
    fn = _import_function(spec, "train.compute_metrics", f"use one of {', '.join(BUILTIN_METRICS)} or "
                                                         "'package.module:function'")
    takes_eval_prediction(fn)
    return fn


def resolve_preprocess(spec: str, compute_metrics):
    """`train.preprocess_logits_for_metrics`: "" or "package.module:function(logits, labels) -> array", for a
    compute_metrics that takes an EvalPrediction (the one that receives logits)."""
    if not spec:
        return None
    field = "train.preprocess_logits_for_metrics"
    if compute_metrics is None or not takes_eval_prediction(compute_metrics):
        raise UserError(field, ("reaches only a train.compute_metrics taking one EvalPrediction (Hugging Face "
                                "Trainer's); set one, or leave this empty"))
    return _import_function(spec, field, "use 'package.module:function'")


def _import_function(spec: str, field: str, hint: str):
    module_name, _, function = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError):
        raise UserError(field, f"cannot import {spec!r}; {hint}") from None
