"""Callbacks of a run (`portable_fsdp.train(config, callbacks=[...])`): objects with any of
`on_step(state, metrics)` after each optimizer step (metrics: the step's loss, lr, grad_norm, ... and "step"),
`on_eval(state, metrics)` after each evaluation (eval_loss, perplexity, ... and "step") and `on_save(state, path)`
after each checkpoint. Imports no framework.

The loop calls them on the main process only (global rank 0, the one that logs), so a callback that prints or
writes does so once. `on_step` or `on_eval` ends the run by raising StopTraining: the ranks agree on it (one tiny
collective a step, only when callbacks are given), stop after that step and save a checkpoint as a normal end does.
"""
from __future__ import annotations

import math


class StopTraining(Exception):
    """Raised by a callback: end the run after this step, with a checkpoint. The message becomes the summary's
    "stopped" line."""


class Callbacks:
    """The callbacks of this process: `callbacks` on the main process, none on the others."""

    def __init__(self, callbacks, is_main: bool):
        self.given = bool(callbacks)  # the same on every rank: whether to agree on a stop
        self._callbacks = list(callbacks) if is_main else []

    def call(self, hook: str, state, value) -> str | None:
        """Call `hook` of every callback that has it; the reason of the first StopTraining, else None."""
        for callback in self._callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(state, value)
            except StopTraining as stop:
                return str(stop) or f"{type(callback).__name__}.{hook} stopped training"
        return None


class EarlyStopping:
    """Stop once `metric` has not improved on the best seen by more than `min_delta` for `patience` evaluations in a
    row — Hugging Face's EarlyStoppingCallback (early_stopping_patience, early_stopping_threshold), with the best
    value kept here rather than by the trainer. `greater_is_better` for metrics such as accuracy."""

    def __init__(self, metric: str = "eval_loss", patience: int = 1, min_delta: float = 0.0,
                 greater_is_better: bool = False):
        self.metric, self.patience, self.min_delta, self.greater_is_better = metric, patience, min_delta, greater_is_better
        self.best: float | None = None
        self.evals_without_improvement = 0

    def on_eval(self, state, metrics: dict) -> None:
        value = metrics.get(self.metric)
        if value is None or math.isnan(value):
            return
        better = self.best is None or (value > self.best if self.greater_is_better else value < self.best)
        if better and (self.best is None or abs(value - self.best) > self.min_delta):
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        if better:
            self.best = value
        if self.evals_without_improvement >= self.patience:
            raise StopTraining(f"early stopping: no better {self.metric} in {self.patience} evals")
