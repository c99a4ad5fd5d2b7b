"""One run per workdir (portable_fsdp/launch/workdir_lock.py): a live holder refuses a second start; a holder that died
(SIGKILL, or a stale file naming a dead pid) is taken over with one warning; another machine's lock counts while
its heartbeat is fresh."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from portable_fsdp.launch import workdir_lock
from tests.conftest import ROOT
from tests.unit._helpers import user_error

HOST = socket.gethostname()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(workdir, **holder):
    record = {"host": HOST, "pid": dead_pid(), "started": "2026-01-01 00:00:00 +0000", "command": "x", **holder}
    (workdir / workdir_lock.NAME).write_text(json.dumps(record) + "\n")


def test_the_lock_names_its_holder_and_is_removed_on_release(tmp_path):
    lock = workdir_lock.acquire(tmp_path, ["python", "-m", "portable_fsdp.run", "--workdir", "w"])
    holder = json.loads((tmp_path / ".lock").read_text())
    assert holder["host"] == HOST and holder["pid"] == os.getpid()
    assert holder["command"] == "python -m portable_fsdp.run --workdir w" and holder["started"]
    lock.release()
    assert not (tmp_path / ".lock").exists()
    workdir_lock.acquire(tmp_path).release()  # free again


def test_a_second_start_is_refused_naming_the_live_run(tmp_path, capsys):
    lock = workdir_lock.acquire(tmp_path)
    before = (tmp_path / ".lock").read_text()
    try:
        with user_error("--workdir", f"is in use by a live run (host {HOST}, pid {os.getpid()}, started "):
            workdir_lock.acquire(tmp_path)  # another open file: flock refuses it as it would another process
    finally:
        assert (tmp_path / ".lock").read_text() == before  # the refused start wrote nothing
        lock.release()
    assert capsys.readouterr().err == ""


def test_the_early_check_refuses_a_live_run_and_writes_nothing(tmp_path):
    workdir_lock.check_free(tmp_path / "new")  # nothing there: fine, and nothing created
    assert not (tmp_path / "new").exists()
    lock = workdir_lock.acquire(tmp_path)
    before = sorted(tmp_path.iterdir()), (tmp_path / ".lock").read_text()
    try:
        with user_error("--workdir", f"(host {HOST}, pid {os.getpid()}, started "):
            workdir_lock.check_free(tmp_path)
        assert (sorted(tmp_path.iterdir()), (tmp_path / ".lock").read_text()) == before
    finally:
        lock.release()
    plant(tmp_path)  # a dead run's file: the start goes on (and `acquire` takes it over)
    workdir_lock.check_free(tmp_path)


def test_a_run_killed_with_sigkill_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from portable_fsdp.launch import workdir_lock; "
         "workdir_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with user_error("--workdir", f"pid {holder.pid}"):
            workdir_lock.acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = workdir_lock.acquire(tmp_path)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: --workdir: taking over {tmp_path} from a run that is no "
                                               f"longer running (host {HOST}, pid {holder.pid}, started ")


@pytest.mark.parametrize("flock_works", [True, False])
def test_a_stale_lock_of_a_dead_pid_on_this_host_is_taken_over(tmp_path, capsys, monkeypatch, flock_works):
    if not flock_works:  # NFS without a lock daemon: the file's host and pid decide
        monkeypatch.setattr(workdir_lock, "_flock", lambda fd, kind=None: None)
    plant(tmp_path)
    workdir_lock.acquire(tmp_path).release()
    assert capsys.readouterr().err.startswith(f"warning: --workdir: taking over {tmp_path} from a run that is no "
                                              "longer running (host ")


def test_without_flock_a_live_pid_on_this_host_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_lock, "_flock", lambda fd, kind=None: None)
    plant(tmp_path, pid=os.getppid())  # pytest's parent: alive, not us
    with user_error("--workdir", f"pid {os.getppid()}"):
        workdir_lock.acquire(tmp_path)


def test_another_machines_lock_holds_while_its_heartbeat_is_fresh(tmp_path, capsys):
    plant(tmp_path, host="node-7", pid=4242)
    with user_error("--workdir", "(host node-7, pid 4242, started 2026-01-01 00:00:00 +0000); choose another "
                    "--workdir, or stop that run first (if it is no longer running, delete "):
        workdir_lock.acquire(tmp_path)
    old = time.time() - workdir_lock.STALE_S - 60
    os.utime(tmp_path / ".lock", (old, old))
    workdir_lock.acquire(tmp_path).release()
    assert "taking over" in capsys.readouterr().err


def test_the_heartbeat_refreshes_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_lock, "HEARTBEAT_S", 0.05)
    lock = workdir_lock.acquire(tmp_path)
    old = time.time() - 1000
    os.utime(tmp_path / ".lock", (old, old))
    time.sleep(0.3)
    assert time.time() - (tmp_path / ".lock").stat().st_mtime < 10
    lock.release()


def test_a_beat_under_way_when_the_lock_is_released_never_touches_a_closed_file(tmp_path, monkeypatch):
    """The heartbeat past its wait as release() runs (a loaded machine): it finishes before the file is closed."""
    import threading

    beating, released = threading.Event(), threading.Event()
    errors = []
    touch = os.utime

    def slow_touch(fd, *args):
        beating.set()
        released.wait(0.5)  # release() runs meanwhile
        try:
            touch(fd, *args)
        except BaseException as err:  # what the thread would die of
            errors.append(err)

    monkeypatch.setattr(workdir_lock, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(workdir_lock.os, "utime", slow_touch)
    lock = workdir_lock.acquire(tmp_path)
    assert beating.wait(5)
    lock.release()
    released.set()
    lock._beat.join(5)
    assert errors == [] and not (tmp_path / ".lock").exists()


def test_a_claim_takes_the_lock_only_for_the_owner(tmp_path):
    with workdir_lock.Claim(lambda: False) as claim:
        claim.take(tmp_path)
        assert not (tmp_path / ".lock").exists()
    with workdir_lock.Claim(lambda: True) as claim:
        claim.take(tmp_path)
        claim.take(tmp_path)  # the checks may run twice in one process: it is held once
        assert (tmp_path / ".lock").exists()
    assert not (tmp_path / ".lock").exists()


def test_a_worker_dies_with_its_launcher(tmp_path):
    """Killed with SIGKILL, the launcher's lock is gone at once: its workers must not train (or save) on."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
         "'import os, time; from portable_fsdp.launch import worker; worker._die_with_launcher(os.getppid()); "
         "print(os.getpid(), flush=True); time.sleep(60)']); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    worker_pid = int(launcher.stdout.readline())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    end = time.monotonic() + 10
    while running(worker_pid):
        assert time.monotonic() < end, "the worker outlived its launcher"
        time.sleep(0.05)


def running(pid: int) -> bool:
    try:  # an orphan that exited may stay a zombie where nothing reaps it
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
