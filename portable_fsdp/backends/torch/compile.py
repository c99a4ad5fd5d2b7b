"""torch.compile of each transformer layer (plan.compile), as torchtitan compiles its blocks.

Each layer (through its CheckpointWrapper when activation checkpointing wraps it, so the recomputation is
compiled too) is compiled in place with `Module.compile(fullgraph=True)` before `fully_shard`: the module keeps
its class and its parameter names (checkpoints read the same keys), and becomes the FSDP unit itself; the hooks
`fully_shard` then registers on it run outside the graph (dynamo skips FSDP's hooks:
torch._dynamo.config.skip_fsdp_hooks). `fullgraph=True` makes anything inside a layer that cannot be traced an
error on the first step instead of a silent fall-back to Python between graph pieces.

The layers of a model are identical modules, so dynamo compiles one graph and reuses it for every layer
(parameters are inputs of the graph, not constants) — as long as nothing else differs between them. The
step calls the model with `use_cache=False` (portable_fsdp/backends/hf_torch/loss.py): with a cache, the layer index each
layer writes to would make every layer a recompilation, and the ninth one would hit dynamo's limit of 8.
"""
from __future__ import annotations

from torch import nn


def apply_compile(units: list) -> None:
    """Compile each of `units` (the model's transformer layers, or their checkpoint wrappers) in place."""
    for unit in units:
        unit.compile(fullgraph=True)


def compiled(module: nn.Module) -> bool:
    """Whether `module` runs through torch.compile (Module.compile sets its compiled call)."""
    return getattr(module, "_compiled_call_impl", None) is not None
