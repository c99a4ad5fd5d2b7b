"""Bytes each rank sends per collective, counted where torch dispatches the collective — FSDP2's all-gathers and
reduce-scatters, DTensor's tensor-parallel all-reduces, the all-to-alls of sequence and expert parallelism and
the step's scalars alike (benchmark code only).

Each call counts what a bandwidth-optimal algorithm sends per rank over a group of n ranks: (n-1)/n of the
gathered output (all-gather) or of the input (reduce-scatter, all-to-all), 2(n-1)/n of the tensor (all-reduce)
— the volumes the formulas in benchmarks/mesh.py speak of, not bytes on a wire (gloo's own algorithms may send
more). Run with plan.cpu_collectives=gloo: FSDP's shared-memory collectives on one host bypass torch's.
"""
from __future__ import annotations

import collections

import torch
from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without namespace and overload) -> (kind, the argument holding the whole tensor, bytes sent × n/(n-1))
OPS = {
    "allreduce_": ("all_reduce", 0, 2), "all_reduce": ("all_reduce", 0, 2),
    "_allgather_base_": ("all_gather", 0, 1), "all_gather_into_tensor": ("all_gather", None, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 1), "reduce_scatter_tensor": ("reduce_scatter", 0, 1),
    "alltoall_base_": ("all_to_all", 1, 1), "all_to_all_single": ("all_to_all", 0, 1),
}
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_size(args) -> int:
    for arg in reversed(args):  # the group comes after the tensors (and after a reduce op's name)
        if isinstance(arg, str):  # functional collectives name their group
            return _resolve_process_group(arg).size()
        if isinstance(arg, torch.ScriptObject):  # c10d ops: the process group boxed (the op's reduce op too)
            try:
                return ProcessGroup.unbox(arg).size()
            except RuntimeError:
                continue
    raise ValueError("no process group among the collective's arguments")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CommBytes(TorchDispatchMode):
    """`with CommBytes() as counter: ...` then `counter.sent` = {kind: bytes this rank sent}."""

    def __init__(self):
        super().__init__()
        self.sent = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if func.namespace in NAMESPACES and name in OPS:
            kind, whole_arg, factor = OPS[name]
            n = _group_size(args)
            # an all-gather's whole tensor is its output; the functional one returns it
            whole = _tensors(out) if whole_arg is None else _tensors(args[whole_arg])
            self.sent[kind] += int(factor * _nbytes(whole) * (n - 1) / n)
        return out
