"""Filling a model built on the meta device (hf_torch.model.create_on_meta) under SPMD, one parameter at a time,
so that the host never holds the whole model: each parameter's full fp32 value is made on the host (the seeded
init replayed, or read from the files) and sent to the devices already sharded by its partition spec — torch_xla
cuts it on the host and transfers each device only its shard (`send_cpu_data_to_device` with a sharding) —
then the host value is dropped. `.to(device)` then `mark_sharding` would not replicate it on every device
either (the SPMD virtual device defers the transfer until the sharding is known: ShardingUtil::XlaMarkSharding
in torch_xla 2.9), but the deferred tensor holds a second host copy of the whole value until then.
SpmdFullyShardedDataParallel keeps parameters already on the device and sharded (its own `.to('xla')` is a
no-op, and it annotates only parameters without a sharding).
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from portable_fsdp.backends.xla import runtime as rt


def materialize_sharded(model: nn.Module, on_meta, device, mesh, specs: dict) -> None:
    """Give every meta parameter of `model` its value from `on_meta.fill`, on `device`, sharded by `specs`
    ({name: partition spec}, layout.parameter_specs); a tied weight stays one parameter, a frozen one stays
    frozen. Then the computed buffers (`on_meta.buffers`), whole."""
    owners: dict = {}  # name -> (module, attribute, requires_grad)
    for name, param in model.named_parameters(remove_duplicate=False):
        prefix, _, attribute = name.rpartition(".")
        owners[name] = (model.get_submodule(prefix), attribute, param.requires_grad)

    def deliver(names, full):
        _release_freed_memory()  # the previous parameter's full value
        spec = next(specs[n] for n in names if n in specs)  # specs name a tied weight once
        param = nn.Parameter(rt.to_device_sharded(mesh, full, spec), requires_grad=owners[names[0]][2])
        for name in names:
            module, attribute, _ = owners[name]
            module._parameters[attribute] = param

    with torch.no_grad():
        on_meta.fill(deliver)
    _release_freed_memory()
    unfilled = [n for n, p in model.named_parameters() if p.is_meta]
    if unfilled:
        raise RuntimeError(f"the model's init delivered no value for {', '.join(unfilled[:3])}")
    moved: dict = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        prefix, _, attribute = name.rpartition(".")
        if id(buffer) not in moved:  # a shared buffer is listed again under its other names
            moved[id(buffer)] = on_meta.buffers[name].to(device)
        model.get_submodule(prefix)._buffers[attribute] = moved[id(buffer)]


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (AttributeError, OSError):
        return None


def _release_freed_memory() -> None:
    """Hand the host allocator's free pages back to the system (glibc's malloc_trim; elsewhere nothing). The full
    values made and dropped one after another leave holes between the shards kept (on PJRT CPU devices the
    shards are host memory too), which stay resident otherwise: 262 MiB of the peak (0.63x the model's bytes)
    for a 110M-parameter Llama on 2 PJRT CPU devices, for ~3 ms a parameter."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
