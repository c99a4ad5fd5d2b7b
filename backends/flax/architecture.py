"""The shape of a Llama, read from a transformers config: what the Flax model is built from.

Only what `LlamaForCausalLM` computes is accepted; anything else (another model type, another
activation, a RoPE type whose frequencies change at run time) is a clear error, not a near miss.
"""
from __future__ import annotations

import dataclasses

from portable_fsdp.backends.flax.rope import inverse_frequencies
from portable_fsdp.errors import UserError


@dataclasses.dataclass(frozen=True)
class LlamaArchitecture:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    inv_freq: tuple = ()  # RoPE inverse frequencies, float32 values (a tuple: hashable, static under jit)
    rope_attention_scaling: float = 1.0

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def from_hf_config(hf_config) -> LlamaArchitecture:
    if getattr(hf_config, "model_type", None) != "llama":
        raise UserError("model.init_from", (
            f"the flax backend builds Llama models only; this config is model_type={hf_config.model_type!r}"))
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UserError("model.init_from", (
            f"hidden_act {hf_config.hidden_act!r} is not supported by the flax backend (silu only)"))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rope_parameters = dict(hf_config.rope_parameters)
    inv_freq, scaling = inverse_frequencies(rope_parameters, head_dim)
    return LlamaArchitecture(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps), tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        inv_freq=tuple(float(f) for f in inv_freq), rope_attention_scaling=float(scaling))


def describe_model(config):
    """ModelInfo for start-up validation, from the same transformers config the torch backends read;
    a model the Flax Llama cannot compute is refused here, before training starts."""
    from portable_fsdp.backends.hf_torch.model import describe_model as describe_torch_model, hf_config

    from_hf_config(hf_config(config.model))
    return describe_torch_model(config)
