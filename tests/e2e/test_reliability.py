"""Faults injected into real runs (PORTABLE_FSDP_FAULTS): kills during saves and steps, a rank that
raises, NaN losses, corrupt checkpoints, and SHARDED -> FULL conversion / resharding on resume."""
import shutil
import subprocess
import sys
import time

import pytest

from portable_fsdp.checkpoint import layout as checkpointing
from tests.conftest import ROOT, TEST_RECIPE, cli, read_metrics

BASE = ["--config", TEST_RECIPE, "--config.train.log_every=1", "--config.train.save_every=5"]


def losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    proc = cli(BASE + ["--workdir", str(workdir)], cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(workdir)


def run_with_fault(tmp_path, fault: str, *extra):
    return cli(BASE + ["--workdir", str(tmp_path), *extra], cwd=tmp_path, env={"PORTABLE_FSDP_FAULTS": fault})


@pytest.fixture(scope="module")
def raised(tmp_path_factory):
    """A run whose rank 1 raised at step 7: (its process, its workdir, checkpoints up to step 5). Copy the workdir
    before changing it."""
    workdir = tmp_path_factory.mktemp("raised")
    began = time.monotonic()
    proc = run_with_fault(workdir, "raise@step:rank=1:step=7")
    return proc, workdir, time.monotonic() - began


def copy_of(raised, tmp_path):
    shutil.copytree(raised[1], tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("fault,latest_after", [
    pytest.param("kill@save.staged:rank=0:step=10", 5, marks=pytest.mark.slow),
    ("kill@save.written:rank=1:step=10", 5),
    pytest.param("kill@commit.manifest:rank=0:step=10", 5, marks=pytest.mark.slow),
    # step_10 is complete, but `latest` was not moved yet
    pytest.param("kill@commit.renamed:rank=0:step=10", 5, marks=pytest.mark.slow),
])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_valid(tmp_path, fault, latest_after):
    proc = run_with_fault(tmp_path, fault)
    assert proc.returncode != 0
    latest = checkpointing.latest(tmp_path)
    assert latest.name == f"step_{latest_after:08d}"
    assert checkpointing.verify(latest)["step"] == latest_after


@pytest.mark.slow  # a kill mid-save leaving the previous checkpoint valid runs by default above
def test_kill_9_mid_save_then_resume_is_bit_exact(tmp_path, straight):
    assert run_with_fault(tmp_path, "kill@save.written:rank=0:step=10").returncode != 0
    proc = cli(BASE + ["--workdir", str(tmp_path), "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path) == straight  # steps 6-10 re-run from step 5 identically, then 11-20


def test_kill_9_of_one_rank_mid_training_stops_all_and_names_it(tmp_path, straight):
    began = time.monotonic()
    proc = run_with_fault(tmp_path, "kill@step:rank=1:step=12")
    assert time.monotonic() - began < 120
    assert proc.returncode == 1
    assert "error: worker rank 1 failed (exit code -9): killed by signal 9" in proc.stderr
    proc = cli(BASE + ["--workdir", str(tmp_path), "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path) == straight


def test_a_rank_that_raises_stops_the_others_with_its_error(raised):
    proc, workdir, took_s = raised
    assert took_s < 120
    assert proc.returncode == 1
    assert "error: worker rank 1 failed (exit code 1)" in proc.stderr
    assert "injected fault at step (rank 1, step 7)" in proc.stderr
    assert checkpointing.latest(workdir).name == "step_00000005"


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path):
    proc = run_with_fault(tmp_path, "nan@step:step=7")
    assert proc.returncode == 3
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: step 7: the loss is nan")
    assert checkpointing.latest(tmp_path).name == "step_00000005"


@pytest.mark.slow  # the NaN check itself runs by default above
def test_nan_loss_can_skip_the_step(tmp_path):
    proc = run_with_fault(tmp_path, "nan@step:step=7", "--config.train.nonfinite=skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert train[-1]["skipped_steps"] == 1 and train[-1]["step"] == 20


def test_a_corrupt_checkpoint_is_refused_on_resume(tmp_path, raised):
    copy_of(raised, tmp_path)
    weights = checkpointing.latest(tmp_path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    proc = cli(BASE + ["--workdir", str(tmp_path), "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: train.resume: ")
    assert "does not match its checksum" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def sharded_at_5(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sharded") / "w"
    proc = cli(BASE + ["--workdir", str(workdir), "--config.plan.state_dict_type=SHARDED_STATE_DICT",
                       "--config.train.stop_at_step=5"], cwd=workdir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


@pytest.mark.parametrize("damage", [
    pytest.param("a tensor's bytes", marks=pytest.mark.slow),  # by default: test_loop's mismatch found while loading
    "a record's header"])
def test_a_corrupt_sharded_checkpoint_is_refused_as_it_loads(tmp_path, sharded_at_5, damage):
    """The checksums are verified while the checkpoint loads: damage the load reads past (a tensor's bytes) is
    found by the rank that hashes it; damage the load trips on (rank 1's first record) is named all the same."""
    workdir = tmp_path / "w"
    shutil.copytree(sharded_at_5, workdir)
    shard = checkpointing.latest(workdir) / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "a tensor's bytes":
        data[len(data) // 2] ^= 0xFF
    else:
        data[30:2000] = bytes(1970)  # the first record's pickle: its tensor no longer parses
    shard.write_bytes(bytes(data))
    proc = cli(BASE + ["--workdir", str(workdir), "--config.plan.state_dict_type=SHARDED_STATE_DICT",
                       "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Terminating process" not in proc.stderr
    assert "__1_0.distcp does not match its checksum" in proc.stderr
    assert max(losses(workdir)) == 5  # not a step trained


def test_resume_into_another_model_shape_is_refused(tmp_path, raised):
    copy_of(raised, tmp_path)
    proc = cli(BASE + ["--workdir", str(tmp_path), "--config.train.resume=true", "--config.model.hidden_size=128"],
               cwd=tmp_path)
    assert proc.returncode == 2 and "model.hidden_size 64 -> 128" in proc.stderr


def test_sharded_checkpoint_converts_resharding_and_loads_everywhere(tmp_path, straight):
    sharded = BASE + ["--config.plan.state_dict_type=SHARDED_STATE_DICT"]
    proc = cli(sharded + ["--workdir", str(tmp_path / "w"), "--config.train.stop_at_step=10"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = checkpointing.latest(tmp_path / "w")
    # Loading a SHARDED checkpoint outside FSDP is refused with the fix.
    proc = cli(BASE + ["--workdir", str(tmp_path / "x"), f"--config.model.init_from={source}"], cwd=tmp_path)
    assert proc.returncode == 2 and "python -m portable_fsdp.convert" in proc.stderr
    # Offline conversion, no process group.
    conv = subprocess.run([sys.executable, "-m", "portable_fsdp.convert", str(source), str(tmp_path / "full")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert conv.returncode == 0, conv.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "full", local_files_only=True)
    assert checkpointing.verify(tmp_path / "full")["state_dict_type"] == "FULL_STATE_DICT"
    # Resume the SHARDED checkpoint on 1 process (torch's distributed checkpoint reshards it).
    proc = cli(sharded + ["--workdir", str(tmp_path / "w"), "--config.train.resume=true", "--nproc", "1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = losses(tmp_path / "w")
    assert all(abs(resumed[s] - straight[s]) <= 1e-5 * straight[s] for s in range(1, 21))


ASYNC_SAVES = ["--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.async_save=true",
               "--config.train.save_every=2"]


@pytest.mark.parametrize("how, saves", [
    ("ctrl-c to the process group", ["--config.train.save_every=0"]),
    # a background save in flight when the signal comes is committed before the interrupted run's own save
    ("ctrl-c to the process group", ASYNC_SAVES),
    pytest.param("SIGTERM to the launcher", ["--config.train.save_every=0"], marks=pytest.mark.slow)],
    ids=["ctrl-c", "ctrl-c with background saves", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_stops_every_worker_and_leaves_no_orphans(tmp_path, how, saves):
    import os
    import signal

    import psutil

    args = [sys.executable, "-m", "portable_fsdp.run", *BASE, "--workdir", str(tmp_path),
            "--config.train.steps=100000", *saves]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = tmp_path / "metrics.jsonl"
        started = metrics.exists() and len(metrics.read_text().splitlines()) >= 3
        if started and (saves != ASYNC_SAVES or checkpointing.latest(tmp_path) is not None):
            break
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2
    if how.startswith("ctrl-c"):
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted by SIG" in stderr and "Traceback" not in stderr and "Warning" not in stderr
    latest = checkpointing.latest(tmp_path)
    assert latest is not None and checkpointing.verify(latest)["step"] >= 3
    time.sleep(1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow  # 15 steps on 4 ranks over 2 cores; by default FULL resumes at the same world size (test_checkpoint_files.py)
def test_full_checkpoint_resumes_on_another_world_size(tmp_path, raised, straight):
    copy_of(raised, tmp_path)  # 2 ranks' FULL checkpoint of step 5
    resumed = cli(BASE + ["--workdir", str(tmp_path), "--config.train.resume=true", "--nproc", "4"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 21))
    assert all(abs(got[s] - straight[s]) <= 1e-5 * straight[s] for s in range(6, 21))  # 4 ranks sum in another order
