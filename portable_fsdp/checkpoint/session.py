"""How the processes of a run save, resume and export checkpoints together, through any backend.

    info = manifest_info(config, plan, backend_name, backend.placement(state))
    saved = save(backend, state, workdir, info, keep_last_n)     # every process; returns the checkpoint's path
    state = resume(backend, state, saved, config, backend_name)  # every process; consumes `state`
    exported = export(backend, state, workdir, info)             # <workdir>/export: FULL weights, no optimizer

The training loop, the Python API (`portable_fsdp.save` / `portable_fsdp.load`) and benchmarks/checkpoint_io.py
all go through here. Each process writes its own files (`Backend.save_checkpoint`, `Backend.export_weights`: which
files, portable_fsdp/checkpoint/files.py) into a staging directory and reports them, checksummed; rank 0 commits
(portable_fsdp/checkpoint/layout.py: manifest last, then the rename and `latest`), so a half-written checkpoint is never
taken for a complete one; a workdir in a bucket then gets it uploaded, its manifest last, after the files of machines
that share no disk, each uploaded by its own machine (portable_fsdp/storage/sync.py). With train.async_save the write
and the commit finish in the background (portable_fsdp/checkpoint/async_save.py). A resume verifies every file's
size, then each process's share of the checksums while the checkpoint loads. Imports no framework.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import pathlib
import shutil
import sys
import threading

from portable_fsdp.checkpoint import async_save, layout as checkpointing

from portable_fsdp.storage import remote as storage, sync
from portable_fsdp.training import faults
from portable_fsdp.backend import Placement
from portable_fsdp.data.batch import DATA_STATE
from portable_fsdp.data.tokenizers import save_for_generation
from portable_fsdp.errors import Interrupted, UserError


def manifest_info(config, plan, backend_name: str, where: Placement) -> dict:
    """What a checkpoint's manifest.json records besides its files and step: the backend, the world size, the
    layout, the plan and the whole config (what a resume checks it against: checkpointing.check_compatible)."""
    info = {"backend": backend_name, "world_size": where.world_size,
            "state_dict_type": plan.state_dict_type.value,
            "plan": json.loads(json.dumps(dataclasses.asdict(plan), default=str)),
            "config": config.to_dict()}
    if config.model.peft.type:  # checkpoints hold the adapters alone: a resume rebuilds the frozen base from here
        info["base_weights"] = config.model.init_from or (
            f"random init of {config.model.config_from or config.model.architecture}, seed {config.seed}")
    return info


def save(backend, state, workdir: pathlib.Path, info: dict, keep_last_n: int = 0, best: dict | None = None,
         data_state: dict | None = None) -> pathlib.Path:
    """Every process: stage, write (each process checksumming its own files), then commit atomically on rank 0
    into <workdir>/checkpoints/step_N. The waits allow for the bytes to write (checkpointing.wait_bound_s).
    `info`: `manifest_info`'s; `keep_last_n`: complete checkpoints kept (0: all); `best`: the eval record that
    marks this checkpoint best (checkpointing.mark_best); `data_state`: the loader's position (a streamed corpus),
    kept as data_state.json. Returns the checkpoint's directory (with train.async_save, once committed)."""
    async_save.finish()  # a save still in flight (train.async_save) is committed before the next is staged
    where = backend.placement(state)
    is_main = where.rank == 0
    timeout = _io_timeout(backend, state, info["config"]["train"])
    staging = checkpointing.staging_dir(workdir, state.step)
    if is_main:
        checkpointing.prepare_staging(workdir, state.step)
    backend.barrier(state, timeout_s=timeout)
    remote = storage.of(workdir)
    apart = remote is not None and _on_several_machines(backend, state, staging)
    faults.check("save.staged", where.rank, state.step)
    result = backend.save_checkpoint(state, staging)
    if apart and isinstance(result, concurrent.futures.Future):  # each machine uploads its files before the commit
        result = result.result()
    in_background = result if isinstance(result, concurrent.futures.Future) else None  # train.async_save
    written = dict((None if in_background else result) or {})
    if is_main:  # what pipeline("text-generation", model=<checkpoint>) needs besides the model
        written.update(save_for_generation(info["config"]["data"]["tokenizer"], staging))
        if data_state is not None:
            (staging / DATA_STATE).write_text(json.dumps(data_state) + "\n")
            written[staging / DATA_STATE] = None
    final = checkpointing.root(workdir) / f"step_{state.step:08d}"
    commit = functools.partial(_commit, workdir, final, state.step, info, keep_last_n, best) if is_main else None
    if in_background:  # reported when written; rank 0 commits once every rank has reported (async_save.py)
        async_save.start(in_background, staging, where.rank, state.step, written, where.processes, timeout, commit)
        return final
    checkpointing.write_report(staging, where.rank, written)
    faults.check("save.written", where.rank, state.step)
    backend.barrier(state, timeout_s=timeout)
    elsewhere = _parts_across_machines(backend, state, remote, staging, f"{sync.CHECKPOINTS}/{final.name}",
                                       info["config"]["train"]["collective_timeout_s"]) if apart else None
    if commit:  # rank 0's own files and the manifest are uploaded last, in the background
        commit(elsewhere=elsewhere)
    backend.barrier(state, timeout_s=timeout)
    return final


def _on_several_machines(backend, state, staging: pathlib.Path) -> bool:
    """Every process, once rank 0 has made the staging directory: whether some process's local working copy lacks
    it (machines that share no disk, each with its own copy of a bucket's workdir); made there."""
    if backend.placement(state).processes == 1:
        return False
    unseen = not staging.is_dir()
    staging.mkdir(parents=True, exist_ok=True)
    return backend.any_rank(state, unseen)


def _parts_across_machines(backend, state, remote, staging: pathlib.Path, prefix: str, floor_s: float) -> dict:
    """Every process, once each has reported into its machine's staging directory (portable_fsdp/storage/sync.py):
    each machine but rank 0's uploads its ranks' files and reports into the bucket's `prefix` while the others
    wait; rank 0 reads those reports back. A machine whose upload failed, or whose reports are missing, fails on
    every process. Returns, on rank 0, the other machines' reports ({path: checksum entry}) for its manifest."""
    where, here = backend.placement(state), sync.machine_ranks(staging)
    uploads, problem, elsewhere = where.rank == here[0] and 0 not in here, None, {}
    if uploads:
        try:
            sync.upload_machine_share(remote, staging, prefix)
        except Exception as err:
            problem = UserError("--workdir", f"the machine of rank(s) {here} could not upload its part of {prefix} "
                                f"to {remote.url}: {err}")
    backend.barrier(state, timeout_s=sync.upload_timeout_s(backend.model_info(state).n_params, floor_s))
    if where.rank == 0:
        try:
            elsewhere = sync.gather_reports(remote, prefix, [r for r in range(where.processes) if r not in here])
        except UserError as err:
            problem = err
    if backend.any_rank(state, problem is not None):
        raise problem or UserError("--workdir", f"saving {prefix} failed on another machine (its error, or rank "
                                   "0's, names it)")
    if uploads:  # the bucket holds this machine's part now
        shutil.rmtree(staging)
    return elsewhere


def export(backend, state, workdir: pathlib.Path, info: dict) -> pathlib.Path:
    """Every process (train.export_full_at_end): the model as a FULL checkpoint holds it, without optimizer state,
    into <workdir>/export; staged, reported and renamed as a save is, with a manifest (checkpointing.commit_export).
    Returns <workdir>/export."""
    rank, remote = backend.placement(state).rank, storage.of(workdir)
    timeout = _io_timeout(backend, state, info["config"]["train"])
    staging = checkpointing.export_staging(workdir)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if remote is not None:  # the export in the bucket is incomplete from now until its new manifest is there
            remote.remove(f"{checkpointing.EXPORT}/{checkpointing.MANIFEST}")
    backend.barrier(state, timeout_s=timeout)
    apart = remote is not None and _on_several_machines(backend, state, staging)
    written = dict(backend.export_weights(state, staging))
    if rank == 0:
        written.update(save_for_generation(info["config"]["data"]["tokenizer"], staging))
    checkpointing.write_report(staging, rank, written)
    backend.barrier(state, timeout_s=timeout)
    elsewhere = _parts_across_machines(backend, state, remote, staging, checkpointing.EXPORT,
                                       info["config"]["train"]["collective_timeout_s"]) if apart else None
    if rank == 0:  # a bucket gets rank 0's files and the manifest with the run's records (sync.push_records)
        checkpointing.commit_export(workdir, {**info, "state_dict_type": "FULL_STATE_DICT",
                                              "step": state.step, "export": True,
                                              "weights_dtype": info["config"]["train"]["save_dtype"]}, elsewhere)
    backend.barrier(state, timeout_s=timeout)
    return pathlib.Path(workdir) / checkpointing.EXPORT


def resume(backend, state, checkpoint: pathlib.Path, config, backend_name: str):
    """Every process: `state` restored from the complete checkpoint directory `checkpoint`, after checking that
    it fits `config`'s model and that `backend_name` reads its layout (checkpointing.check_compatible). Every
    process checks every file's size, then checksums its share of the bytes in a thread while the checkpoint loads
    (the load only fills memory, and hashing releases the interpreter's lock): training starts only once every
    process's share has matched; a mismatch found by one stops them all. Consumes `state`: use the one returned."""
    checkpoint, where = pathlib.Path(checkpoint), backend.placement(state)
    try:
        manifest, problem = checkpointing.verify_sizes(checkpoint), None
    except UserError as err:
        manifest, problem = None, err
    _stop_together(backend, state, config, problem, checkpoint)  # before the load's collectives
    checkpointing.check_compatible(manifest, config, backend_name)
    dtype = manifest.get("weights_dtype", "float32")
    if dtype != "float32" and where.rank == 0:
        print(f"warning: {checkpoint.name} holds its weights in {dtype} (train.save_dtype): they are cast back to "
              "the training dtype, so this resume is not bit-exact", file=sys.stderr, flush=True)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-verify") as pool:
        checking = pool.submit(checkpointing.verify_checksums, checkpoint, manifest, where.rank, where.processes, stop)
        try:
            state = backend.load_checkpoint(state, checkpoint, manifest)
        except BaseException as err:  # dcp's CheckpointException is not an Exception
            stop.set()
            if isinstance(err, (KeyboardInterrupt, SystemExit, Interrupted)):
                raise
            # bytes that do not parse: a corrupt file is named, whichever rank's share it is in
            found = checking.exception()
            if found is None:
                checkpointing.verify_checksums(checkpoint, manifest)
                raise
            raise found from None
        problem = checking.exception()
    _stop_together(backend, state, config, problem, checkpoint)
    return state


def _stop_together(backend, state, config, problem: UserError | None, checkpoint: pathlib.Path) -> None:
    """A file found corrupt by one rank stops every rank, with its line on the rank that found it."""
    if backend.placement(state).processes > 1:
        backend.barrier(state, timeout_s=_io_timeout(backend, state, config.train))
        if backend.any_rank(state, problem is not None) and problem is None:
            problem = UserError("train.resume", f"another rank found a file of {checkpoint} that does not match its "
                                f"checksum in {checkpointing.MANIFEST} (its line names it); resume from another "
                                "checkpoint")
    if problem:
        raise problem


def _io_timeout(backend, state, train) -> float:
    """The bound on every wait around a save or a verification: the same number on every rank."""
    return checkpointing.wait_bound_s(backend.model_info(state).n_params, train["collective_timeout_s"])


def _commit(workdir: pathlib.Path, final: pathlib.Path, step: int, info: dict, keep_last_n: int,
            best: dict | None, elsewhere: dict | None = None) -> None:
    """Rank 0, once every rank has written and reported its files; `elsewhere`: the reports of the ranks on other
    machines, whose files are in the bucket already."""
    if best:  # before the commit prunes, so the new best is spared
        checkpointing.mark_best(workdir, final, best)
    if info["state_dict_type"] == "FULL_STATE_DICT":
        info = {**info, "weights_dtype": info["config"]["train"]["save_dtype"]}
    checkpointing.commit(workdir, step, info, keep_last_n, elsewhere)
    remote = storage.of(workdir)
    if remote is not None:  # a workdir in a bucket: the commit there (portable_fsdp/storage/sync.py), while training
        # goes on: no wait of the other ranks is bounded by the upload
        async_save.in_background(functools.partial(sync.commit_checkpoint, remote, workdir, final, keep_last_n,
                                                   frozenset(elsewhere or ())),
                                 f"portable_fsdp-upload-{step}")
