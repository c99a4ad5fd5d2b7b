"""A flax.nnx Llama that computes what transformers' LlamaForCausalLM computes — and Qwen2ForCausalLM,
MistralForCausalLM and MixtralForCausalLM, which differ from it in biases, a sliding window and a mixture of
experts (architecture.py).

Module and parameter names mirror the Hugging Face ones (`model.layers.0.self_attn.q_proj`), so weight
conversion is a renaming plus a transpose of each linear kernel (flax keeps [in, out]). Dtypes follow
the parameters: cast the parameters to the compute dtype and the whole forward runs in it, as under
torch's FSDP2 MixedPrecisionPolicy; RMSNorm variance and softmax statistics stay in float32.

Parameters travel as a flat dict {"model.layers.0.self_attn.q_proj.kernel": array}; `ModelDef.apply`
binds such a dict to the module graph inside a traced function. A `Layout` (sharding.py) says where the
activations go on the mesh; the default places nothing.

Mixtral's experts are dropless and routed: each token runs through the experts it chose only, and the router's
weights combine their outputs — the sum transformers forms (moe.py: a grouped matmul per device; under `ep`, the
tokens go to their experts' devices and back by all-to-all).
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
from flax import nnx

from portable_fsdp.backends.flax import moe, torch_weights
from portable_fsdp.backends.flax.architecture import LlamaArchitecture
from portable_fsdp.backends.flax.loss import chunked_token_loss_sum
from portable_fsdp.backends.flax.sharding import Layout
from portable_fsdp.training.loss_chunks import Chunking

NO_LAYOUT = Layout()


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float):
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        h = x.astype(jnp.float32)
        variance = jnp.mean(h * h, axis=-1, keepdims=True)
        h = h * jax.lax.rsqrt(variance + self.eps)
        return self.weight[...] * h.astype(dtype)


def rotary_cos_sin(arch: LlamaArchitecture, positions, dtype):
    """cos, sin of shape [b, s, 1, head_dim] (one head axis to broadcast over)."""
    inv_freq = jnp.asarray(arch.inv_freq, dtype=jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(angles) * arch.rope_attention_scaling
    sin = jnp.sin(angles) * arch.rope_attention_scaling
    return cos.astype(dtype)[:, :, None, :], sin.astype(dtype)[:, :, None, :]


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def attention_mask(positions, window: int = 0):
    """Causal, and within one packed document: a document starts wherever the position does not follow
    the previous one (transformers' rule for packed rows without an attention mask). With a sliding `window`,
    only the keys fewer than `window` tokens back (transformers' sliding_window_overlay). [b, 1, 1, q, k]."""
    first = positions[:, :1] - 1
    starts = jnp.diff(positions, axis=-1, prepend=first) != 1
    documents = jnp.cumsum(starts, axis=-1)
    seq = positions.shape[1]
    distance = jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :]
    causal = (distance >= 0) & (distance < window) if window else distance >= 0
    same_document = documents[:, :, None] == documents[:, None, :]
    return (causal[None] & same_document)[:, None, None]


def grouped_attention(q, k, v, mask, scale: float):
    """q [b, s, heads, d], k/v [b, s, kv_heads, d]; query head h reads kv head h // groups (repeat_kv)."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, s, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype).reshape(b, s, heads * d)


class Attention(nnx.Module):
    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs):
        def linear(n_in, n_out, bias=arch.attention_bias):
            return nnx.Linear(n_in, n_out, use_bias=bias, rngs=rngs)

        self.q_proj = linear(arch.hidden_size, arch.num_heads * arch.head_dim)
        self.k_proj = linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim)
        self.v_proj = linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim)
        self.o_proj = linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.output_bias)
        self.head_dim = arch.head_dim

    def __call__(self, x, cos, sin, mask, layout: Layout):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, -1, self.head_dim)
        k = self.k_proj(x).reshape(b, s, -1, self.head_dim)
        v = self.v_proj(x).reshape(b, s, -1, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Ulysses SP: from each device's tokens to its heads of the whole sequence (one all-to-all each), and back.
        q, k, v = (layout.heads(layout.tokens(t)) for t in (q, k, v))
        return self.o_proj(layout.tokens(grouped_attention(q, k, v, mask, self.head_dim**-0.5)))


class MLP(nnx.Module):
    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(arch.hidden_size, arch.intermediate_size, use_bias=arch.mlp_bias, rngs=rngs)
        self.up_proj = nnx.Linear(arch.hidden_size, arch.intermediate_size, use_bias=arch.mlp_bias, rngs=rngs)
        self.down_proj = nnx.Linear(arch.intermediate_size, arch.hidden_size, use_bias=arch.mlp_bias, rngs=rngs)

    def __call__(self, x, layout: Layout):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)), None


class Experts(nnx.Module):
    """Mixtral's experts, fused as transformers keeps them: gate_up_proj [E, 2, hidden, I] (the gate, then the up
    projection; torch's [E, 2I, hidden]), down_proj [E, I, hidden] (torch's [E, hidden, I]) — [in, out] per
    expert like every kernel here, so a tensor-parallel split of I gives each tp rank its part of gate and up."""

    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs):
        e, h, i = arch.num_experts, arch.hidden_size, arch.intermediate_size
        init = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, 2, h, i), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), jnp.float32))

    def __call__(self, x, weights, chosen, layout: Layout):
        """x [b, s, hidden]; weights, chosen [b, s, top_k]: each token's experts and their router weights."""
        return moe.routed_experts(x, weights, chosen, self.gate_up_proj[...], self.down_proj[...], layout.mesh,
                                  layout.expert_axes, layout.platform)


class SparseMoeBlock(nnx.Module):
    """transformers' MixtralSparseMoeBlock: softmax over the router's logits (float32), the top k kept and
    renormalised. Returns (output, the load-balancing statistics when the loss is on: per expert the tokens
    routed to it and the sum of its routing probabilities)."""

    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs):
        self.gate = nnx.Linear(arch.hidden_size, arch.num_experts, use_bias=False, rngs=rngs)
        self.experts = Experts(arch, rngs)
        self.top_k = arch.experts_per_token
        self.balance = arch.router_aux_loss_coef > 0

    def __call__(self, x, layout: Layout):
        logits = self.gate(x)
        num_experts = logits.shape[-1]
        top, chosen = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), self.top_k)
        top = top / jnp.sum(top, axis=-1, keepdims=True)
        stats = None
        if self.balance:  # transformers' load_balancing_loss_func: softmax in the logits' dtype, counts of top k
            probs = jax.nn.softmax(logits, axis=-1)
            _, picked = jax.lax.top_k(probs, self.top_k)
            counts = jnp.sum(jax.nn.one_hot(picked, num_experts, dtype=jnp.float32), axis=(0, 1, 2))
            stats = (counts, jnp.sum(probs.astype(jnp.float32), axis=(0, 1)))
        return self.experts(x, top, chosen, layout), stats


class DecoderLayer(nnx.Module):
    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs):
        self.self_attn = Attention(arch, rngs)
        self.mlp = SparseMoeBlock(arch, rngs) if arch.num_experts else MLP(arch, rngs)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, layout: Layout):
        """(hidden states, the MoE layer's load-balancing statistics or None)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layout)
        out, stats = self.mlp(self.post_attention_layernorm(x), layout)
        return x + out, stats


def _run_layer(layer: DecoderLayer, x, cos, sin, mask, layout):
    return layer(x, cos, sin, mask, layout)


# Activation checkpointing: each layer's activations are recomputed in backward instead of stored.
_run_layer_rematerialized = nnx.remat(_run_layer, static_argnums=(5,))


class LlamaModel(nnx.Module):
    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs, remat: bool = False):
        self.embed_tokens = nnx.Embed(arch.vocab_size, arch.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(arch, rngs) for _ in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.arch = arch
        self.remat = remat

    def __call__(self, input_ids, positions, layout: Layout = NO_LAYOUT):
        """(final hidden states, the load-balancing statistics summed over layers, or None)."""
        h = layout.hidden(self.embed_tokens(input_ids))
        cos, sin = rotary_cos_sin(self.arch, positions, h.dtype)
        windows = self.arch.sliding_windows or (0,) * len(self.layers)
        masks = {window: attention_mask(positions, window) for window in set(windows)}
        run = _run_layer_rematerialized if self.remat else _run_layer
        total = None
        for layer, window in zip(self.layers, windows):
            h, stats = run(layer, h, cos, sin, masks[window], layout)
            h = layout.hidden(h)
            if stats is not None:
                total = stats if total is None else jax.tree.map(jnp.add, total, stats)
        return self.norm(h), total


class LlamaForCausalLM(nnx.Module):
    def __init__(self, arch: LlamaArchitecture, rngs: nnx.Rngs, remat: bool = False):
        self.model = LlamaModel(arch, rngs, remat)
        self.lm_head = None if arch.tie_word_embeddings else nnx.Linear(
            arch.hidden_size, arch.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids, positions, layout: Layout = NO_LAYOUT):
        """(logits, the router's load-balancing loss — 0 without one)."""
        h, stats = self.model(input_ids, positions, layout)
        logits = self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return logits, load_balancing_loss(stats, input_ids.size * len(self.model.layers))

    def loss_sum(self, input_ids, positions, labels, chunking: Chunking, layout: Layout = NO_LAYOUT):
        """(Σ token losses under `labels`, projected and reduced a chunk at a time, never the whole batch's
        logits; the router's load-balancing loss — 0 without one)."""
        h, stats = self.model(input_ids, positions, layout)
        kernel = self.model.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
        total = chunked_token_loss_sum(h, kernel, labels, chunking)
        return total, load_balancing_loss(stats, input_ids.size * len(self.model.layers))


def load_balancing_loss(stats, rows: int):
    """transformers' load_balancing_loss_func over every layer's tokens (`rows` = tokens × layers), unweighted:
    num_experts × Σ_e (fraction of top-k assignments to e) × (mean routing probability of e). The sums run over
    the whole batch the program sees — every row of every device, never per device."""
    if stats is None:
        return jnp.float32(0.0)
    counts, probs = stats
    return counts.shape[0] * jnp.sum((counts / rows) * (probs / rows))


def dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def undotted(name: str) -> tuple:
    """The inverse of `dotted`: list indices are ints in nnx paths."""
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The module graph without values, and how to bind a flat parameter dict to it."""

    arch: LlamaArchitecture
    graphdef: object
    variables: dict  # dotted name -> abstract nnx.Variable (shape, dtype and kind, no value)

    @property
    def shapes(self) -> dict:
        return {name: var.get_value() for name, var in self.variables.items()}

    @property
    def router_aux_loss_coef(self) -> float:
        return self.arch.router_aux_loss_coef

    def bind(self, params: dict) -> LlamaForCausalLM:
        state = nnx.from_flat_state({undotted(name): var.replace(params[name])
                                     for name, var in self.variables.items()})
        return nnx.merge(self.graphdef, state)

    def plan_name(self, name: str) -> str:
        """The transformers name a tensor-parallel plan's patterns are matched against."""
        return torch_weights.torch_name(name)

    # FULL checkpoints keep the parameters in torch's names and layout (torch_weights.py).
    def saved_name(self, name: str) -> str:
        return torch_weights.torch_name(name)

    def saved_layout(self, name: str, array):
        return torch_weights.to_torch_layout(name, array)

    def read_saved(self, directory) -> dict:
        """{flax name: numpy array} of a FULL checkpoint's weights."""
        return torch_weights.read_safetensors_dir(directory, self.variables, self.arch)

    def apply(self, params: dict, input_ids, positions, layout: Layout = NO_LAYOUT):
        """Logits [b, s, vocab] in the parameters' dtype."""
        return self.forward(params, input_ids, positions, layout)[0]

    def forward(self, params: dict, input_ids, positions, layout: Layout = NO_LAYOUT):
        """(logits, the router's load-balancing loss: 0 for a dense model or without output_router_logits)."""
        return self.bind(params)(input_ids, positions, layout)

    def loss_sum(self, params: dict, input_ids, positions, labels, chunking: Chunking, layout: Layout = NO_LAYOUT):
        """(Σ token losses, the router's load-balancing loss), the logits a chunk at a time (LlamaForCausalLM)."""
        return self.bind(params).loss_sum(input_ids, positions, labels, chunking, layout)


def define(arch: LlamaArchitecture, remat: bool = False) -> ModelDef:
    """No weights are drawn here (abstract evaluation); they come from the torch model, converted."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(arch, nnx.Rngs(0), remat))
    graphdef, state = nnx.split(abstract)
    variables = {dotted(path): var for path, var in nnx.to_flat_state(state)}
    return ModelDef(arch, graphdef, variables)
