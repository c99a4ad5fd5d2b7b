"""Several JAX processes (one per machine, joined by devices.join): what changes when the mesh spans devices
this process cannot address.

Every helper is for `jax.process_count() > 1` alone; the single-process lowering does not call them, so it
runs exactly as before. The mesh is the global one; each process reads its own rows of the global batch
(placement: dp_rank = the block of mesh rows its devices hold) and places them with
`make_array_from_process_local_data`; host numbers (label tokens, flags) are summed or or-ed over processes
with one small allgather; results a caller reads on the host are gathered whole on every process.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils



def several() -> bool:
    return jax.process_count() > 1


def local_devices(mesh) -> list:
    """The mesh's devices this process drives, in mesh order."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def data_slice(mesh) -> tuple:
    """(dp_rank, dp_size) of this process's rows of the global batch (portable_fsdp.placement.host_data_slice)."""
    from portable_fsdp.placement import DATA_AXES, host_data_slice

    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    row_field = next((f"plan.{a}_size" for a in ("tp", "sp", "cp") if mesh.shape[a] > 1), "plan.cp_size")
    return host_data_slice(mine, mesh.devices.size, int(np.prod([mesh.shape[a] for a in DATA_AXES])), row_field)


def to_global(local: np.ndarray, target) -> jax.Array:
    """This process's rows of a global batch, onto the mesh as `target` (rows over the data axis) shards them."""
    return jax.make_array_from_process_local_data(target, local)


def total(value: int) -> int:
    """The sum of an integer over processes."""
    return int(np.sum(multihost_utils.process_allgather(np.int64(value))))


def anyone(flag: bool) -> bool:
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def barrier(name: str = "portable_fsdp.barrier") -> None:
    multihost_utils.sync_global_devices(name)


def gather(tree):
    """Every array whole, as numpy, on every process: global arrays (all processes call it: a collective), or
    host arrays of this process's rows concatenated in process order."""
    return multihost_utils.process_allgather(tree, tiled=True)
