"""Runs whose workdir is a bucket (s3:// on the session's S3-compatible server, tests/conftest.py): saved,
killed while a checkpoint is uploaded, and resumed from the bucket alone, with the losses of a run never stopped; on
one machine and on two that share no disk."""
import json
import shutil

import pytest

from benchmarks.common import free_port, run_python
from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.storage import remote as storage, sync
from tests.conftest import TEST_RECIPE, cli
from tests.e2e.machines import ARGS, ENV, losses, run_together
from tests.unit.test_cluster import slurm_step

BASE = ["--config", TEST_RECIPE, "--config.train.log_every=1", "--config.train.save_every=5"]


def run(url, tmp_path, *extra, fault=None):
    return cli(BASE + ["--workdir", url, *extra], cwd=tmp_path, env={"PORTABLE_FSDP_FAULTS": fault or ""})


def bucket_losses(url) -> dict:
    lines = storage.open_remote(url).read_text("metrics.jsonl").splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def resumed_after_a_kill(url, tmp_path, fault, *extra):
    """Killed at `fault`, the local working copy then lost (another machine resumes), resumed from the bucket."""
    assert run(url, tmp_path, *extra, fault=fault).returncode != 0
    bucket = storage.open_remote(url)
    assert sync.committed(bucket)[-1] == "step_00000005"
    assert bucket.read_text("checkpoints/latest").strip() == "step_00000005"
    shutil.rmtree(storage.local_workdir(url))
    proc = run(url, tmp_path, "--config.train.resume=true", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return bucket


@pytest.mark.parametrize("fault", [
    pytest.param("kill@upload.files:rank=0:step=10", marks=pytest.mark.slow),  # committed here, not in the bucket
    pytest.param("kill@save.written:rank=1:step=10", marks=pytest.mark.slow),
])
def test_a_kill_during_an_upload_resumes_from_the_bucket_with_the_losses_of_an_uninterrupted_run(
        bucket, tmp_path, fault):
    straight = f"{bucket}/straight"
    assert run(straight, tmp_path).returncode == 0
    killed = resumed_after_a_kill(f"{bucket}/killed", tmp_path, fault)
    assert bucket_losses(f"{bucket}/killed") == bucket_losses(straight)
    assert sync.committed(killed)[-1] == "step_00000020"
    leftovers = [n for n in killed.children("checkpoints") if n.startswith("step_")]
    assert leftovers == sync.committed(killed)  # the half upload of step 10 was removed
    assert sorted(p.name for p in (storage.local_workdir(straight) / "checkpoints").glob("step_*")) == \
        ["step_00000020"]  # the local copy holds about one checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("backend,extra", [
    ("cpu", ["--config.plan.state_dict_type=SHARDED_STATE_DICT"]),
    ("cpu", ["--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.async_save=true"]),
    ("xla", []),
    ("flax", []),
])
def test_save_and_resume_through_a_bucket_on_every_backend_and_layout(bucket, tmp_path, backend, extra):
    url, options = f"{bucket}/run", ["--backend", backend, *extra]
    straight = run(f"{bucket}/straight", tmp_path, *options)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # killed once the save before it is committed (a background one too): the bucket holds step 5
    resumed_after_a_kill(url, tmp_path, "kill@save.staged:rank=0:step=10", *options)
    assert bucket_losses(url) == bucket_losses(f"{bucket}/straight")


def test_a_second_run_into_a_bucket_that_holds_checkpoints_is_refused(bucket, tmp_path):
    bucket_run = storage.open_remote(f"{bucket}/run")
    bucket_run.write_text("checkpoints/latest", "step_00000005\n")
    proc = run(f"{bucket}/run", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --workdir: {bucket}/run already holds checkpoints; pass --config.train.resume=true to continue "
        "from them, or choose a new --workdir")


@pytest.mark.parametrize("url,env,expected", [
    ("s3://no-such-bucket/run", {}, "the bucket no-such-bucket does not exist; create it or choose another --workdir"),
    ("s3://{bucket}/run", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE":
                           "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"},
     "no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"),
    ("ftp://host/run", {}, "ftp:// is not a supported storage; use a local directory, s3://bucket/path or "
     "gs://bucket/path"),
])
def test_an_unusable_bucket_is_one_line_before_any_worker_starts(bucket, tmp_path, url, env, expected):
    url = url.format(bucket=bucket.removeprefix("s3://"))
    proc = cli(BASE + ["--workdir", url], cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --workdir: {url}: {expected}"]


def on_two_machines(url, tmp_path, *extra, fault=None) -> None:
    """`srun --nodes 2 --ntasks-per-node 1 python ARGS --nproc 1 --workdir URL` on two nodes stood on this machine,
    each with its own local working copy (no disk shared): killed by `fault`, else both must exit 0."""
    port = str(free_port())
    run_together([([*ARGS, "--nproc", "1", "--workdir", url, *extra],
                   {**slurm_step(2, 1, node, nodelist="localhost,127.0.0.1", MASTER_PORT=port),
                    "PORTABLE_FSDP_LOCAL_WORKDIRS": str(tmp_path / f"machine_{node}"),
                    "PORTABLE_FSDP_FAULTS": fault or ""}) for node in range(2)], succeed=fault is None)


@pytest.mark.parametrize("extra", [
    pytest.param([], marks=pytest.mark.slow),
    pytest.param(["--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.export_full_at_end=true"],
                 marks=pytest.mark.slow),
    pytest.param(["--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.async_save=true"],
                 marks=pytest.mark.slow),
])
def test_two_machines_that_share_no_disk_save_and_resume_through_the_bucket(bucket, tmp_path, extra):
    url, options = f"{bucket}/run", ["--config.train.save_every=3", *extra]
    straight = run_python([*ARGS, "--nproc", "2", "--workdir", f"{bucket}/straight", *options], 300, ENV)
    assert straight.returncode == 0, straight.stderr[-3000:]
    on_two_machines(url, tmp_path, *options, fault="kill@save.staged:rank=0:step=6")
    remote = storage.open_remote(url)
    assert sync.committed(remote) == ["step_00000003"]
    listed = json.loads(remote.read_text(f"checkpoints/step_00000003/{checkpointing.MANIFEST}"))["files"]
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(listed)  # one from each machine
    assert set(listed) <= set(remote.sizes("checkpoints/step_00000003"))
    on_two_machines(url, tmp_path, "--config.train.resume=true", *options)
    assert bucket_losses(url) == bucket_losses(f"{bucket}/straight")
    machine_0 = tmp_path / "machine_0" / url.replace("://", "/")  # its local copy, which rank 0's records are in
    resumed = {step: rest for step, *rest in losses(machine_0)}  # the steps run again after the kill replace theirs
    assert list(resumed.items()) == [(step, rest) for step, *rest in losses(storage.local_workdir(
        f"{bucket}/straight"))]  # with the grad norms, bit for bit
    assert sync.committed(remote)[-1] == "step_00000006"
    if "--config.train.export_full_at_end=true" in extra:
        exported = json.loads(remote.read_text(f"{checkpointing.EXPORT}/{checkpointing.MANIFEST}"))["files"]
        assert set(exported) <= set(remote.sizes(checkpointing.EXPORT))
