"""A small language model of one's own in flax.nnx, no transformers inside: the twin of torch_mlp.py.

Token embedding -> blocks of (LayerNorm, Linear d->4d, tanh-approximated GELU, Linear 4d->d, residual) ->
LayerNorm -> Linear d->vocab without bias. Attribute names match the torch module's state-dict names
(embed, layers.N.norm/up/down, norm, head), so `load_torch_state_dict` copies its weights by name and both
compute the same logits.

    import portable_fsdp as pf
    from flax import nnx
    from examples.custom_model.nnx_mlp import MLPLanguageModel

    config = pf.get_config("llama_tiny:test")
    model = MLPLanguageModel(vocab_size=config.model.vocab_size, rngs=nnx.Rngs(0))
    pf.train(config, backend="flax", model=model)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLPBlock(nnx.Module):
    def __init__(self, hidden_size: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(hidden_size, epsilon=1e-5, rngs=rngs)
        self.up = nnx.Linear(hidden_size, 4 * hidden_size, rngs=rngs)
        self.down = nnx.Linear(4 * hidden_size, hidden_size, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x)), approximate=True))


class MLPLanguageModel(nnx.Module):
    _no_split_modules = ["MLPBlock"]  # the layer class FSDP wraps (and counts as a layer)

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, hidden_size, rngs=rngs)
        self.layers = nnx.List([MLPBlock(hidden_size, rngs=rngs) for _ in range(num_layers)])
        self.norm = nnx.LayerNorm(hidden_size, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(hidden_size, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids, position_ids=None):
        """Logits [batch, seq, vocab]; an MLP mixes no tokens, so position_ids change nothing."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def load_torch_state_dict(model: MLPLanguageModel, state_dict: dict) -> None:
    """Copy the torch twin's state dict (tensors or numpy arrays, by name) into `model`: torch's Linear weight is
    [out, in] where an nnx kernel is [in, out], and a LayerNorm's weight is its scale."""
    def array(name):
        value = state_dict[name]
        return jnp.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value))

    def linear(module: nnx.Linear, prefix: str):
        module.kernel.set_value(array(f"{prefix}.weight").T)
        if module.bias is not None:
            module.bias.set_value(array(f"{prefix}.bias"))

    def norm(module: nnx.LayerNorm, prefix: str):
        module.scale.set_value(array(f"{prefix}.weight"))
        module.bias.set_value(array(f"{prefix}.bias"))

    model.embed.embedding.set_value(array("embed.weight"))
    for index, layer in enumerate(model.layers):
        norm(layer.norm, f"layers.{index}.norm")
        linear(layer.up, f"layers.{index}.up")
        linear(layer.down, f"layers.{index}.down")
    norm(model.norm, "norm")
    linear(model.head, "head")
