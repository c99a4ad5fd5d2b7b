"""A language model that is not a transformers model, to train with your own parts on the torch backends
(cpu, cuda, xla):

    import portable_fsdp as pf
    from examples.custom_model.torch_mlp import MLPLanguageModel, token_mean_loss

    with torch.device("meta"):  # each process then fills only its own shards
        model = MLPLanguageModel(vocab_size=256, hidden_size=64, num_layers=2)
    state = pf.init(config, plan, "cpu", model=model, loss=token_mean_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))

Each token is predicted from itself alone (no attention): a stack of residual MLP blocks between an embedding and
an output projection. The Flax backend's twin keeps these attribute names, so one set of weights loads into both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class MLPBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.up = nn.Linear(hidden_size, 4 * hidden_size)
        self.down = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))


class MLPLanguageModel(nn.Module):
    _no_split_modules = ["MLPBlock"]  # the unit FSDP wraps (plan.transformer_layer_cls_to_wrap left empty)
    _tp_plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(MLPBlock(hidden_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab]; `position_ids` is accepted and unused (no attention)."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def init_weights(self) -> None:
        """What a model built on the meta device is initialised with (the seed is the run's)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def token_mean_loss(outputs: torch.Tensor, batch) -> tuple:
    """The mean cross-entropy over labelled tokens, as (sum, count): the step divides Σ sum by Σ count."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    total = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total, (batch.labels != IGNORE_INDEX).sum()
