"""SIGINT / SIGTERM during training: note the request, let the loop finish the step, agree across ranks,
save a checkpoint and stop (train.save_on_interrupt). A second signal, seconds later, stops at once. And the
other way round: a helper process that the kernel stops when its parent dies (`die_with_parent`)."""
from __future__ import annotations

import ctypes
import os
import signal
import time

from portable_fsdp.errors import Interrupted


REPEAT_AFTER_S = 3.0


class InterruptFlag:
    def __init__(self):
        self.requested = None  # the signal name, once one arrives
        self._first = 0.0
        self._previous = {}

    def install(self) -> "InterruptFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        # Ctrl-C reaches a worker twice (from the terminal, then forwarded by the launcher): only a signal
        # well after the first means "stop now, without waiting for the step and the save".
        if self.requested and time.monotonic() - self._first > REPEAT_AFTER_S:
            raise Interrupted(signal.Signals(signum).name, saved=None)
        if not self.requested:
            self.requested, self._first = signal.Signals(signum).name, time.monotonic()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when `parent_pid`, its parent, dies (PR_SET_PDEATHSIG; Linux only,
    elsewhere nothing is tied). False when that parent is not (or no longer) this process's parent."""
    if os.getppid() != parent_pid:
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return True
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    return os.getppid() == parent_pid  # it may have died before the signal was armed
