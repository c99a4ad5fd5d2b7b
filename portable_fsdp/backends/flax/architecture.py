"""The shape of a Llama, read from a transformers config: what the Flax model is built from.

The families that are a Llama with a few switches are built by the same model: Qwen2 (biases on q/k/v, none
on o), Mistral (a sliding attention window) and Mixtral (Mistral with a mixture of experts for its MLP: a top-k
softmax router over `num_experts` experts, and the router's load-balancing loss when its config sets
output_router_logits). Only what their transformers models compute is accepted;
anything else (another model type — refused at start-up by the capability table —, another activation, a
RoPE type whose frequencies change at run time) is a clear error, not a near miss.
"""
from __future__ import annotations

import dataclasses

from portable_fsdp.backends.flax.rope import inverse_frequencies
from portable_fsdp.capabilities import FLAX_FAMILIES
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
    attention_bias: bool = False  # on q/k/v
    output_bias: bool = False  # on o_proj (Llama's attention_bias sets both; Qwen2 has q/k/v only)
    mlp_bias: bool = False
    sliding_windows: tuple = ()  # per layer: keys within this many tokens of the query (0: no window)
    inv_freq: tuple = ()  # RoPE inverse frequencies, float32 values (a tuple: hashable, static under jit)
    rope_attention_scaling: float = 1.0
    num_experts: int = 0  # a MoE MLP (Mixtral) in every layer when > 0; intermediate_size is then an expert's
    experts_per_token: int = 0
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight; 0 when output_router_logits is off

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def from_hf_config(hf_config) -> LlamaArchitecture:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FLAX_FAMILIES:
        raise UserError("model.model_type", (
            f"{model_type} is not implemented by --backend flax, which builds {', '.join(FLAX_FAMILIES)} models; "
            "train it with --backend cpu, cuda or xla"))
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UserError("model.init_from", (
            f"hidden_act {hf_config.hidden_act!r} is not supported by the flax backend (silu only)"))
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise UserError("model.init_from", (
            f"router_jitter_noise {hf_config.router_jitter_noise} (random noise on the router's inputs) is not "
            "applied by the flax backend; set it to 0 in the model's config.json, or train with --backend cpu, "
            "cuda or xla"))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rope_parameters = dict(hf_config.rope_parameters)
    inv_freq, scaling = inverse_frequencies(rope_parameters, head_dim)
    return LlamaArchitecture(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps), tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        output_bias=bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), sliding_windows=sliding_windows(hf_config),
        inv_freq=tuple(float(f) for f in inv_freq), rope_attention_scaling=float(scaling), **experts(hf_config))


def experts(hf_config) -> dict:
    """Mixtral's MoE settings ({} for a dense model)."""
    if not getattr(hf_config, "num_local_experts", 0):
        return {}
    coef = float(hf_config.router_aux_loss_coef) if getattr(hf_config, "output_router_logits", False) else 0.0
    return {"num_experts": int(hf_config.num_local_experts), "experts_per_token": int(hf_config.num_experts_per_tok),
            "router_aux_loss_coef": coef}


def sliding_windows(hf_config) -> tuple:
    """Each layer's sliding attention window as transformers applies it (0: the whole causal prefix):
    Mistral's `sliding_window` on every layer; Qwen2's on the layers `layer_types` marks sliding."""
    window = getattr(hf_config, "sliding_window", None) or 0
    layer_types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def describe_model(config):
    """ModelInfo for start-up validation, from the same transformers config the torch backends read. A
    family the Flax model does not build is left to the capability table (model.model_type), which refuses it
    by name; a config of a built family that it cannot compute is refused here, before training starts."""
    from portable_fsdp.backends.hf_torch.model import describe_model as describe_torch_model, hf_config

    info = describe_torch_model(config)
    if info.model_type in FLAX_FAMILIES:
        from_hf_config(hf_config(config.model))
    return info
