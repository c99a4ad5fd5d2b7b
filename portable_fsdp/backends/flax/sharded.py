"""SHARDED_STATE_DICT checkpoints of the Flax lowering, written and read by orbax-checkpoint.

`sharded/` holds orbax's files for {"params", "opt_state"}: every JAX process writes only the shards its own
devices hold (tensorstore OCDBT: `ocdbt.process_<i>/`, `array_metadatas/process_<i>`), process 0 the tree's
metadata and the merged index; nothing is gathered. Orbax writes into a temporary directory beside `sharded/`,
inside the loop's staging directory, and renames it once every process is done: the checkpoint as a whole is still
committed by the loop's own rename (portable_fsdp.checkpoint.layout), so a crash mid-write leaves the previous
checkpoint as `latest`. A resume restores every array with the sharding the current mesh gives it (any device
count, any mesh); the step is the manifest's. The format is orbax's, which only this backend reads
(`sharded_format`, portable_fsdp/backends/flax/launch.py).

train.async_save: orbax's AsyncCheckpointer returns once the arrays are copied to host memory; the write, orbax's
rename and the listing of this process's files finish in a thread, as the future the loop waits for
(portable_fsdp/checkpoint/async_save.py).
"""
from __future__ import annotations

import concurrent.futures
import pathlib
import re

import jax
import orbax.checkpoint as ocp

from portable_fsdp.checkpoint import layout as checkpointing


def save(state, sharded: pathlib.Path):
    """Every process: its shards into `sharded` (a checkpoint's sharded/). Returns {path: None} of the files this
    process wrote (checksummed by the checkpoint session); with train.async_save, a future of it."""
    sharded = pathlib.Path(sharded)
    train = state.ctx.config.train
    timeout = checkpointing.wait_bound_s(state.ctx.info.n_params, train.collective_timeout_s)
    checkpointer = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(),
                                         async_options=ocp.options.AsyncOptions(timeout_secs=int(timeout)))
    checkpointer.save(sharded, args=ocp.args.StandardSave({"params": state.params, "opt_state": state.opt_state}))

    def finish() -> dict:
        checkpointer.close()  # waits for the write and orbax's rename; raises the write's error
        return {path: None for path in _files_of(sharded, jax.process_index())}

    if not train.async_save:
        return finish()
    background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-orbax")
    future = background.submit(finish)
    background.shutdown(wait=False)
    return future


def _files_of(sharded: pathlib.Path, process: int) -> list:
    """The files of `sharded` that `process` wrote: those under a `…process_<i>` directory or file are process
    i's; the rest (metadata, the merged index) process 0's."""
    files = []
    for path in sorted(p for p in sharded.rglob("*") if p.is_file()):
        owners = [int(m.group(1)) for part in path.relative_to(sharded).parts
                  for m in [re.search(r"process_(\d+)$", part)] if m]
        if (owners[0] if owners else 0) == process:
            files.append(path)
    return files


def load(state, directory: pathlib.Path) -> tuple:
    """(params, opt_state) from `directory`/sharded, placed as this state's are: orbax reads each device's slice
    of every array, whatever mesh wrote it."""
    target = {"params": state.params, "opt_state": state.opt_state}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), target)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(pathlib.Path(directory) / checkpointing.SHARDED,
                                        args=ocp.args.StandardRestore(abstract))
    return restored["params"], restored["opt_state"]
