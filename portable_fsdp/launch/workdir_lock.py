"""One run per workdir: the process that owns a run (our launcher, or global rank 0 under torchrun) holds
WORKDIR/.lock for the run's life, so a second start into the same workdir is refused before it writes anything,
instead of interleaving its records with the first run's and racing on its checkpoints.

The lock is an flock(2) on the file, which the kernel drops when its holder dies (even by SIGKILL). The file
also names its holder (host, pid, start time, command), refreshed every HEARTBEAT_S: on a disk shared by several
machines flock may not reach across them, so a lock left by another machine counts as live while its holder
keeps refreshing it; on this machine a holder that is not a live process is gone, and its lock is taken over
with one warning line. A run that ends removes the file. Imports no framework."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import shlex
import socket
import sys
import threading
import time

from portable_fsdp.errors import UserError

NAME = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0  # a lock from another machine untouched this long is left by a run that is gone


class WorkdirLock:
    """A held lock: `release()` (or the process's end) gives it up."""

    def __init__(self, path: pathlib.Path, fd: int):
        self.path, self._fd = path, fd
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="workdir-lock", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self._fd)
            except OSError:  # a disk that went away: the run itself will say so
                pass

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        self._beat.join()  # a beat already past its wait touches the file before it is closed, never after
        try:
            if _same_file(self.path, self._fd):
                self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None


class Claim:
    """What a launcher holds for its run: the lock, from `take(workdir)` on, when `owner()` says this process owns
    the run (asked only then: on a TPU the answer needs the environment set up first); nothing otherwise."""

    def __init__(self, owner):
        self._owner, self.lock, self._also = owner, None, []

    def check(self, workdir: pathlib.Path) -> None:
        """Refuse at once, before the run's checks, when a live run holds `workdir` (see `check_free`)."""
        if self.lock is None and self._owner():
            check_free(workdir)

    def take(self, workdir: pathlib.Path) -> None:
        if self.lock is None and self._owner():
            self.lock = acquire(workdir)

    def hold(self, lock) -> None:
        """Release `lock` (a workdir in a bucket: its lock object) with this claim's own."""
        self._also.append(lock)

    def release(self) -> None:
        while self._also:
            self._also.pop().release()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def acquire(workdir: pathlib.Path, command: list | None = None) -> WorkdirLock:
    """Take WORKDIR/.lock (the workdir must exist) or raise UserError naming the live run that holds it."""
    path = pathlib.Path(workdir) / NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncated before it is ours
        try:
            locked = _flock(fd)
            if not _same_file(path, fd):  # its run ended and removed the file between our open and flock
                os.close(fd)
                continue
            holder = _read(fd)
            if locked is False or (holder and _holder_live(holder, locked, os.fstat(fd).st_mtime)):
                raise UserError("--workdir", _refusal(workdir, holder))
            if holder:
                print(f"warning: --workdir: taking over {workdir} from a run that is no longer running "
                      f"({_describe(holder)})", file=sys.stderr, flush=True)
            _write(fd, command)
            return WorkdirLock(path, fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise


def check_free(workdir: pathlib.Path) -> None:
    """UserError when a live run holds `workdir`; writes nothing (a start that will be refused learns it before
    seconds of checks). Not a claim: the run may still lose the workdir to another start before `acquire`."""
    try:
        fd = os.open(pathlib.Path(workdir) / NAME, os.O_RDONLY)
    except OSError:  # no lock file (or none we can read: `acquire` will say)
        return
    try:
        locked = _flock(fd, fcntl.LOCK_SH)  # held for an instant: it conflicts only with a holder's LOCK_EX
        holder = _read(fd)
        if locked is False or (holder and _holder_live(holder, locked, os.fstat(fd).st_mtime)):
            raise UserError("--workdir", _refusal(workdir, holder))
    finally:
        os.close(fd)


def _flock(fd: int, kind: int = fcntl.LOCK_EX) -> bool | None:
    """True: locked; False: another open file holds it; None: this filesystem has no locks (NFS without lockd)."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _holder_live(holder: dict, locked: bool | None, refreshed: float) -> bool:
    """Whether the run named in a lock file we could take (flock) or could not test (None) is still running."""
    if holder.get("host") != socket.gethostname():  # flock may not reach across machines: trust the heartbeat
        return time.time() - refreshed < STALE_S
    if locked:  # on this machine the kernel's word is final: its holder is gone
        return False
    return holder.get("pid") != os.getpid() and pid_alive(holder.get("pid"))


def pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _same_file(path: pathlib.Path, fd: int) -> bool:
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _read(fd: int) -> dict:
    """The holder's record; {} for an empty file (a run that has just taken it) or an unreadable one."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode(errors="replace").strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": None, "note": "unreadable lock file"}
    return holder if isinstance(holder, dict) else {}


def _write(fd: int, command: list | None) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "command": shlex.join(command if command is not None else sys.orig_argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)


def _describe(holder: dict) -> str:
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("started"):
        parts.append(f"started {holder['started']}")
    return ", ".join(parts)


def _refusal(workdir, holder: dict) -> str:
    if not holder:  # it has just taken the lock and not yet written its name
        return f"{workdir} is in use by a run that is starting; choose another --workdir, or stop that run first"
    text = (f"{workdir} is in use by a live run ({_describe(holder)}); choose another --workdir, or stop that run "
            "first")
    if holder.get("host") != socket.gethostname():
        text += (f" (if it is no longer running, delete {pathlib.Path(workdir) / NAME}, or wait {STALE_S / 60:.0f} "
                 "minutes for its lock to go stale)")
    return text
