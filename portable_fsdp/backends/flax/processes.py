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

from portable_fsdp.errors import UserError


def several() -> bool:
    return jax.process_count() > 1


def local_devices(mesh) -> list:
    """The mesh's devices this process drives, in mesh order."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def data_slice(mesh) -> tuple:
    """(dp_rank, dp_size): this process's devices hold whole rows of the mesh (every cp, sp and tp device of them:
    the axes that share a batch row), one contiguous block of the same size on every process, so its slice of
    the batch is rows dp_rank of dp_size."""
    from portable_fsdp.placement import DATA_AXES

    row_count = int(np.prod([mesh.shape[a] for a in DATA_AXES]))
    grid = mesh.devices.reshape(row_count, -1)  # the data axes are the outer ones
    mine = [i for i in range(grid.shape[0]) if any(d.process_index == jax.process_index() for d in grid[i])]
    whole = all(d.process_index == jax.process_index() for i in mine for d in grid[i])
    if not mine or not whole or mine != list(range(mine[0], mine[0] + len(mine))) or grid.shape[0] % len(mine):
        field = next((f"plan.{a}_size" for a in ("tp", "sp", "cp") if mesh.shape[a] > 1), "plan.cp_size")
        raise UserError(field, (
            f"the devices that share a batch row ({grid.shape[1]}: cp x sp x tp) span machines: each machine's "
            f"devices must hold whole rows of the mesh; make cp_size x sp_size x tp_size a divisor of this machine's "
            f"device count ({len(local_devices(mesh))})"))
    return mine[0] // len(mine), grid.shape[0] // len(mine)


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
