"""What the unsharded model says at init on the eval sequences the parity runs use (tests/dist/fsdp_variants.py):
per-token losses and argmax, the truth every sharded eval_loss and gathered prediction is checked against."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from portable_fsdp.backends.hf_torch.model import create_model
from portable_fsdp.data.loader import build_token_data
from tests.dist.fsdp_variants import EVAL_SEQUENCES
from tests.parity.matrix import make_config

EVAL_RTOL = 1e-6


@functools.lru_cache(maxsize=1)
def reference_eval() -> dict:
    config = make_config({})
    model = create_model(config, rank=0, rank0_only=False)
    data = build_token_data(config.data, config.model.vocab_size, 1)
    sequences = np.asarray(data.eval[:EVAL_SEQUENCES], dtype=np.int64)  # the cache stores uint16
    inputs, labels = torch.from_numpy(sequences[:, :-1]), torch.from_numpy(sequences[:, 1:])
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    token_losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return {"token_losses": token_losses.numpy().astype(np.float64), "logits": logits, "inputs": inputs,
            "argmax": logits.argmax(-1).numpy(), "batch": config.train.eval_batch_size}


def check_eval_loss(result: dict, ref: dict) -> float:
    """The run's eval_loss at init is Σ token losses / Σ tokens of the unsharded model; returns the truth."""
    losses = ref["token_losses"]
    truth = losses.sum() / losses.size
    got = result["initial_eval"]
    assert got["eval_tokens"] == losses.size  # counted before sharding, once per batch
    assert got["eval_loss"] == pytest.approx(truth, rel=EVAL_RTOL)
    return truth


def check_predictions(result: dict, ref: dict) -> None:
    """The first eval batch's predictions: every row of the batch (not group-size times), full length, in order."""
    predictions = np.array(result["first_predictions"])
    batch = ref["batch"]
    assert predictions.shape == (batch, ref["argmax"].shape[1])
    assert (predictions == ref["argmax"][:batch]).all()
