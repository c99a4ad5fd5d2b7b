"""One run per workdir in a bucket: the `.lock` object, created only if absent (a conditional create on the
server), names its holder and is rewritten every HEARTBEAT_S; a lock not rewritten for STALE_S is left by a run that
is gone (on this machine: one whose process has ended) and is taken over with one warning line. The run's end
removes it. The local working copy keeps its own flock (portable_fsdp.launch.workdir_lock) as well. Imports no
framework."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid

from portable_fsdp.errors import UserError
from portable_fsdp.launch.workdir_lock import HEARTBEAT_S, NAME, STALE_S, pid_alive
from portable_fsdp.storage.remote import Remote


class BucketLock:
    """A held lock: `release()` gives it up."""

    def __init__(self, remote: Remote, record: dict, heartbeat_s: float):
        self.remote, self.record = remote, record
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="bucket-lock", daemon=True)
        self._beat.start()

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.remote.write_text(NAME, json.dumps({**self.record, "refreshed": time.time()}))
            except OSError:  # the run's own uploads will say what is wrong
                pass

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._beat.join()
        holder = _holder(self.remote)
        if holder and holder.get("token") == self.record["token"]:
            self.remote.remove(NAME)


def _holder(remote: Remote) -> dict | None:
    text = remote.read_text(NAME)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"host": "?", "pid": None, "refreshed": 0.0}


def _live(holder: dict, stale_s: float) -> bool:
    """A holder on this machine is live while its process is (a run killed with SIGKILL leaves its object
    behind); one on another machine while it refreshes the object."""
    if holder.get("host") == socket.gethostname():
        return holder.get("pid") != os.getpid() and pid_alive(holder.get("pid"))
    return time.time() - holder.get("refreshed", 0.0) < stale_s


def acquire(remote: Remote, stale_s: float = STALE_S, heartbeat_s: float = HEARTBEAT_S) -> BucketLock:
    """Take `<url>/.lock`, or raise UserError naming the live run that holds it."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    for _ in range(2):  # a stale lock is removed once, then created again
        try:
            remote.write_text(NAME, json.dumps({**record, "refreshed": time.time()}), exclusive=True)
            return BucketLock(remote, record, heartbeat_s)
        except FileExistsError:
            holder = _holder(remote) or {}
            if _live(holder, stale_s):
                break
            print(f"warning: --workdir: taking over {remote.url} from a run that is no longer running (host "
                  f"{holder.get('host')}, pid {holder.get('pid')})", file=sys.stderr, flush=True)
            remote.remove(NAME)
    holder = _holder(remote) or {}
    raise UserError("--workdir", f"{remote.url} is in use by a live run (host {holder.get('host', '?')}, pid "
                    f"{holder.get('pid', '?')}, started {holder.get('started', '?')}); choose another --workdir, or "
                    f"stop that run first (if it is no longer running, delete {remote.url}/{NAME}, or wait "
                    f"{stale_s / 60:.0f} minutes for its lock to go stale)")
