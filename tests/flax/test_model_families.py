"""The flax backend builds the families that are a Llama with switches — Qwen2 (q/k/v biases) and Mistral (a
sliding window, 32 tokens over 64-token sequences in the tiny model) — and computes what transformers does:
logits on the same weights, and losses of a CLI run (2 JAX host devices) against the plain-torch reference.
The families it does not build are refused at start-up (tests/e2e/test_model_families.py)."""
import numpy as np
import pytest
import torch

from tests.flax.test_model import FP32_LOGIT_TOLERANCE, flax_logits, torch_logits
from tests.parity import families

WINDOWED = {"qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),  # layer 1 only
            "mistral": dict(sliding_window=16)}


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_logits_equal_transformers(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, **WINDOWED[family])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases and norm scales, so a mix-up cannot hide behind zeros and ones
        for p in hf_model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    input_ids = np.random.default_rng(1).integers(0, 97, (3, 48))
    positions = np.broadcast_to(np.arange(48), input_ids.shape).copy()
    positions[1, 20:] = np.arange(28)  # a second packed document in row 1
    difference = np.abs(flax_logits(hf_model, input_ids, positions) - torch_logits(hf_model, input_ids, positions))
    assert difference.max() <= FP32_LOGIT_TOLERANCE


@pytest.mark.parametrize("family", ["qwen2", pytest.param("mistral", marks=pytest.mark.slow)])
def test_family_trains_like_plain_torch_on_flax(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("flax", model, tmp_path)
