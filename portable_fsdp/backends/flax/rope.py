"""Rotary-embedding inverse frequencies from a Hugging Face `rope_parameters` dict (numpy, no framework).

Computed in float32 step by step as transformers does (modeling_rope_utils), so the Flax model rotates
by the same angles as LlamaForCausalLM. Types whose frequencies depend on the sequence seen at run
time (dynamic, longrope) are refused rather than approximated.
"""
from __future__ import annotations

import math

import numpy as np

from portable_fsdp.errors import UserError

SUPPORTED = ("default", "linear", "llama3")


def inverse_frequencies(rope_parameters: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling applied to cos/sin)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED:
        raise UserError("model.init_from", (
            f"rope_type {rope_type!r} is not supported by the flax backend (supported: {', '.join(SUPPORTED)})"))
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError("model.init_from", "partial_rotary_factor != 1 is not supported by the flax backend")
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(rope_parameters["rope_theta"]), exponents)).astype(np.float32)
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope_parameters["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, rope_parameters)
    return inv_freq.astype(np.float32), 1.0


def _llama3_scaling(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between interpolated."""
    factor = np.float32(p["factor"])
    low_freq_factor, high_freq_factor = p["low_freq_factor"], p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((np.float32(old_context_len) / wavelen - np.float32(low_freq_factor))
              / np.float32(high_freq_factor - low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
