"""The shared evaluation layer: eval_loss = Σ token losses / Σ label tokens over every rank, divided once.

A backend's `eval_step(state, batch)` returns {"loss_sum", "tokens"} already summed over all ranks,
with the tokens counted from the batch as the loader gave it (before any sequence sharding).
"""
from __future__ import annotations

import math


def evaluate(eval_step, state, batches) -> dict:
    loss_sum, tokens = 0.0, 0
    for batch in batches:
        out = eval_step(state, batch)
        loss_sum += out["loss_sum"]
        tokens += out["tokens"]
    if tokens == 0:
        raise ValueError("evaluation saw no label tokens")
    eval_loss = loss_sum / tokens
    return {"eval_loss": eval_loss, "eval_tokens": tokens, "perplexity": math.exp(min(eval_loss, 50.0))}
