"""The files each process writes into a checkpoint, the same on every backend (layout: portable_fsdp.checkpoint.layout).

    FULL_STATE_DICT     optimizer.pt (main process), written in a thread while the weights stream;
                        the weights (safetensors shards, each written by the process that owns its file);
                        config.json + generation_config.json (main process)
    SHARDED_STATE_DICT  config.json (main process), then sharded/ (every process its own shards)
    both                rng/rank_XXXXX.pt (every process; none where training draws no random numbers)
    an export           the FULL weights and config, nothing else (train.export_full_at_end)

A backend's `save_checkpoint` and `export_weights` (portable_fsdp.backend.Backend) call `write` and `write_export`
with its `Writer`: the few functions that differ between frameworks, each producing one kind of file. Which files
a checkpoint has, which process writes each and in which order (the order of the collectives: every process runs
the same) is decided here, once. The manifest and the atomic commit come after, in the checkpoint session
(portable_fsdp/checkpoint/session.py), once every process has reported what it wrote. Imports no framework.
"""
from __future__ import annotations

import concurrent.futures
import pathlib
from typing import Callable, NamedTuple

from portable_fsdp.checkpoint import layout as checkpointing


class Writer(NamedTuple):
    """A backend's writers of one state, as functions (its checkpoint module builds one per save). Every process
    calls each, in the same order, and each may be a collective, unless said otherwise. Files are returned as
    {path: checksum entry (checkpointing.HashingWriter's, when hashed while written) or None (checksummed by the
    checkpoint session afterwards)}: those this process wrote."""

    # This process's index; 0 is the main process, which writes the files only one process writes.
    rank: int
    # A FULL_STATE_DICT checkpoint (the plan's state_dict_type); else SHARDED_STATE_DICT.
    full: bool
    # (directory) -> files: the FULL weights as save_pretrained lays them out (safetensors shards of
    # train.max_shard_size + index, in train.save_dtype: portable_fsdp.checkpoint.safetensors_shards), one parameter gathered
    # at a time, each process writing the shard files it owns.
    weights: Callable[[pathlib.Path], dict]
    # () -> torch's full optimizer state dict ({"state": {name: {...}}, "param_groups": [...]}, keyed by parameter
    # name), whole on the main process (what the others get is dropped), in host memory: the main process writes
    # it in a thread while the weights stream. None: the backend keeps no portable state for this optimizer (no
    # optimizer.pt; a resume restarts the optimizer).
    optimizer_state: Callable[[], object] | None
    # (directory, full) -> files; main process only, no collective: the model's config.json (with `full`, what
    # from_pretrained needs to load the weights beside it: the class to build, train.save_dtype) and
    # generation_config.json where the backend writes one.
    model_config: Callable[[pathlib.Path, bool], dict]
    # (directory) -> files: this process's shards of the weights and optimizer state into `directory` (the
    # checkpoint's sharded/, which may not exist yet), in the backend's own format (checkpointing.SHARDED_FORMATS);
    # with train.async_save a backend may return, once the state is copied, a concurrent.futures.Future of the
    # files instead (portable_fsdp/checkpoint/async_save.py finishes the save).
    sharded: Callable[[pathlib.Path], object]
    # (obj, file) -> None: torch.save, `file` a path or a HashingWriter (the format of optimizer.pt and rng/*.pt).
    torch_save: Callable[[object, object], None]
    # () -> this process's RNG states, no collective; None where training draws no random numbers.
    rng_state: Callable[[], object] | None = None


def write(files: Writer, directory: pathlib.Path):
    """Every process, into `directory` (which exists: the main process made it): its files of a checkpoint.
    Returns {path: checksum entry or None} of them, or a future of it (a SHARDED save in the background)."""
    directory = pathlib.Path(directory)
    if files.full:
        written = _full(files, directory, with_optimizer=True)
    else:
        written = files.model_config(directory, False) if files.rank == 0 else {}
    written.update(_rng(files, directory))
    if files.full:
        return written
    return joined(written, files.sharded(directory / checkpointing.SHARDED))


def write_export(files: Writer, directory: pathlib.Path) -> dict:
    """Every process, into `directory` (which exists): the FULL checkpoint's weights and model config, without
    optimizer state or RNG (train.export_full_at_end). Returns {path: checksum entry or None} of its files."""
    return _full(files, pathlib.Path(directory), with_optimizer=False)


def _full(files: Writer, directory: pathlib.Path, with_optimizer: bool) -> dict:
    """The weights, optimizer.pt and the model config. The optimizer state is gathered first (a collective); the
    main process writes it in a thread while the weights stream to the shard files the other processes own first
    (safetensors_shards), so its write overlaps theirs."""
    main = files.rank == 0
    with_optimizer = with_optimizer and files.optimizer_state is not None
    gathered = files.optimizer_state() if with_optimizer else None
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-optimizer") as pool:
        optimizer_file = pool.submit(_write_optimizer, files, gathered, directory) if with_optimizer and main else None
        del gathered  # the thread's reference only: freed once written
        written = dict(files.weights(directory))
        if optimizer_file is not None:
            written.update(optimizer_file.result())
    if main:
        written.update(files.model_config(directory, True))
    return written


def _write_optimizer(files: Writer, state, directory: pathlib.Path) -> dict:
    with checkpointing.HashingWriter(directory / checkpointing.OPTIMIZER) as f:
        files.torch_save(state, f)
    return {f.path: f.digest}


def _rng(files: Writer, directory: pathlib.Path) -> dict:
    if files.rng_state is None:
        return {}
    saved = files.rng_state()
    path = checkpointing.rng_file(directory, files.rank)
    path.parent.mkdir(exist_ok=True)
    files.torch_save(saved, path)
    return {path: None}


def joined(written: dict, sharded):
    """`written` and the SHARDED files, or a future of both once a background write has finished."""
    if not isinstance(sharded, concurrent.futures.Future):
        return {**written, **sharded}
    joined = concurrent.futures.Future()

    def settle(done: concurrent.futures.Future) -> None:
        try:
            joined.set_result({**written, **done.result()})
        except BaseException as err:
            joined.set_exception(err)

    sharded.add_done_callback(settle)
    return joined
