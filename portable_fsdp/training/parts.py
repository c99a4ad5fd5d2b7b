"""Parts of a run the user brings instead of the config's (`portable_fsdp.init(config, plan, model=..., loss=...,
optimizer=..., schedule=...)`, `portable_fsdp.train(config, model=..., ...)`): each is optional, and a part left
out is the config's. Imports no framework; each backend reads the parts its framework can run.

- `model`: a `torch.nn.Module` (cpu, cuda, xla; on the meta device for a model too big for one process) or a
  `flax.nnx.Module` (flax), called as `model(input_ids, position_ids=...)` (position_ids when its forward takes them)
  and returning logits [batch, seq, vocab] or an object with `.logits`. Its layer classes are wrapped as the plan
  says (`transformer_layer_cls_to_wrap`, empty: the module's `_no_split_modules`) and its `_tp_plan` (transformers'
  pattern -> colwise|rowwise dict) places it over tp.
- `loss`: `loss(outputs, batch) -> (sum, count)`: `outputs` what the model returned for this process's part of
  the batch, `batch` that part (`LossInputs`: input_ids, labels, position_ids as the framework's arrays). The
  step's loss is Σ sum / Σ count over the whole accumulated global batch (every micro-batch, every data-parallel
  and sequence-sharded rank), as the built-in token-mean loss is.
- `optimizer`: torch: a factory `optimizer(params) -> torch.optim.Optimizer`; flax: an optax GradientTransformation
  made with `optax.inject_hyperparams` (its learning_rate is set each step, as the torch optimizer's lr is).
- `schedule`: `schedule(step) -> learning rate` for optimizer update `step` (counted from 0), in place of the
  config's train.lr / warmup / lr_schedule.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple


class LossInputs(NamedTuple):
    """What a custom loss reads besides the model's outputs: this process's part of a micro-batch (a sequence slice
    under context or sequence parallelism), labels already shifted (IGNORE_INDEX where no token is predicted)."""

    input_ids: Any
    labels: Any
    position_ids: Any


@dataclasses.dataclass(frozen=True)
class Parts:
    model: Any = None
    loss: Callable | None = None
    optimizer: Any = None
    schedule: Callable | None = None

    def given(self) -> tuple:
        """The names of the parts given, for messages ("model", "loss", ...)."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)


NONE = Parts()
