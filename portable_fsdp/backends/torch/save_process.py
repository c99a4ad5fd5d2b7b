"""train.async_save on cpu/cuda: a process per rank that writes the staged SHARDED state while training goes on.

Written in a thread, dcp's writer shares the interpreter's lock with the training steps (it serialises each tensor
in Python); a process of its own shares nothing but the host's memory bandwidth and disk. The writer is spawned at
the first background save and lives until `close` (the backend's finalize):
- its rank's staged state is in shared memory (the stager's buffers), so a request passes file descriptors, not
  bytes;
- the writers form their own gloo group for dcp's plan and metadata collectives (a rendezvous at a free port that
  rank 0 picks), so the training process group is never used off the training thread;
- Ctrl-C reaches every process of the terminal's group: the writer ignores SIGINT (blocked while it is spawned, so
  not even its start-up is interrupted) and the training process decides — it waits for the save in flight, then
  closes the writer;
- it runs at a lower CPU priority than training (nice +10): where every core is busy, the steps come first and
  the write takes the time they leave;
- it dies with its rank (PR_SET_PDEATHSIG on Linux; elsewhere when the request pipe closes) and prints nothing:
  its standard output, where gloo's banner goes, is /dev/null; errors come back to the rank as exceptions.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import pathlib
import signal
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.launch.interrupts import die_with_parent

class WriterFailed(RuntimeError):
    """The writer process died or raised; the message names the rank."""


class _Writer:
    def __init__(self, timeout_s: float):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        address = [(os.environ.get("MASTER_ADDR", "127.0.0.1"), _free_port()) if rank == 0 else None]
        dist.broadcast_object_list(address, src=0)  # every rank's first background save: all at once
        context = mp.get_context("spawn")
        self._requests, child_end = context.Pipe()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process = context.Process(target=_serve, name=f"portable_fsdp-writer-{rank}", daemon=True,
                                           args=(child_end, rank, world_size, *address[0], timeout_s, os.getpid()))
            with _no_gpus_for_children():
                self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child_end.close()
        self.rank, self.timeout_s, self._ready = rank, timeout_s, False
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-writer")

    def write(self, staging: concurrent.futures.Future, checkpoint_id: str) -> dict:
        """In the pool's thread: hand the staged state to the writer once `staging` has it, and wait until it is on
        disk. Returns {path: manifest entry} of the files it wrote (fsynced and checksummed there)."""
        staged = staging.result()
        if not self._ready:
            self._reply()  # the writer's start-up (imports, its group's rendezvous)
            self._ready = True
        try:
            self._requests.send((staged, checkpoint_id))
        except OSError:  # the pipe is broken: the writer is gone
            raise self._died() from None
        return {pathlib.Path(path): entry for path, entry in self._reply().items()}

    def _reply(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while not self._requests.poll(1.0):
            if not self.process.is_alive():
                raise self._died()
            if time.monotonic() > deadline:
                raise WriterFailed(f"rank {self.rank}'s checkpoint writer did not finish within {self.timeout_s:.0f} s")
        try:
            ok, reply = self._requests.recv()
        except EOFError:
            raise self._died() from None
        if not ok:
            raise WriterFailed(f"rank {self.rank}'s checkpoint writer failed: {reply}")
        return reply

    def _died(self) -> WriterFailed:
        self.process.join()
        return WriterFailed(f"rank {self.rank}'s checkpoint writer process died (exit code {self.process.exitcode}); "
                            "the checkpoint in progress is not committed")

    def close(self) -> None:
        """The writer stops after the request in flight, if any (the loop waits for that one first); one that
        does not stop within 30 s is killed."""
        self.pool.shutdown(wait=False)
        try:
            self._requests.send(None)
        except OSError:  # it is gone already
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@contextlib.contextmanager
def _no_gpus_for_children():
    """While the writer is spawned: it writes host memory only, yet dcp's writer opens a CUDA context (on GPU 0:
    hundreds of MiB of every rank's writer on one GPU, or a failed save where GPUs are exclusive) wherever it sees
    a GPU. The spawned process inherits the environment with no GPU visible; this process, whose CUDA runtime
    read CUDA_VISIBLE_DEVICES when it started, keeps its own."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


_writer: _Writer | None = None


def submit(staging: concurrent.futures.Future, checkpoint_id: str, timeout_s: float) -> concurrent.futures.Future:
    """Every rank, from the training thread: a future of {path: manifest entry} of the files this rank's part of
    the state `staging` gives (its shards, in shared memory, left untouched until then) is written to under
    `checkpoint_id`. The first call spawns the writers; `timeout_s` bounds their collectives and each wait on them."""
    global _writer
    if _writer is None:
        _writer = _Writer(timeout_s)
    return _writer.pool.submit(_writer.write, staging, checkpoint_id)


def close() -> None:
    """Stop this rank's writer (after the save in flight, if any): at the end of the run."""
    global _writer
    if _writer is not None:
        _writer, writer = None, _writer
        writer.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _serve(requests, rank: int, world_size: int, host: str, port: int, timeout_s: float, parent: int) -> None:
    """The writer process: join the writers' group, then write each staged state sent until None (or the pipe
    closes), fsync and checksum its files, and reply (True, {path: manifest entry}) or (False, the error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a Ctrl-C pending since the spawn is dropped
    if not die_with_parent(parent):  # the rank is gone already
        return
    os.nice(10)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
    from portable_fsdp.backends.torch import sharded_writer

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        requests.send((True, {}))
    except Exception as err:
        requests.send((False, _one_line(err)))
        return
    try:
        while True:
            try:
                request = requests.recv()
            except EOFError:
                return
            if request is None:
                return
            staged, checkpoint_id = request
            try:
                reply = True, {str(path): entry or checkpointing.digest(path)
                               for path, entry in sharded_writer.save(staged, checkpoint_id, rank).items()}
            except BaseException as err:  # dcp's CheckpointException is one
                reply = False, _one_line(err)
            del staged, request
            requests.send(reply)
    finally:
        dist.destroy_process_group()


def _one_line(err: BaseException) -> str:
    """The error a writer reports: the first rank's own, out of dcp's CheckpointException (all ranks' tracebacks)."""
    failures = getattr(err, "failures", None)
    if failures:
        err = getattr(next(iter(failures.values())), "exception", err)
    return f"{type(err).__name__}: {err}"
