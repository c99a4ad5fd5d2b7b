"""Checkpoints across meshes, as users run them: a FULL checkpoint written under tensor parallelism resumes under
plain FSDP on another world size (and the other way round, into 2-D fsdp x tp placements), a SHARDED one resumes
at the same mesh bit-exactly. Each is a stop at step 10 and a resume to step 20 of the test recipe."""
import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

STEPS, STOP = 20, 10


def run(workdir, nproc: int, plan: dict, state_dict_type: str, *extra: str):
    args = ["--backend", "cpu", "--nproc", str(nproc), "--config", TEST_RECIPE, "--workdir", str(workdir),
            "--config.train.log_every=1", f"--config.plan.state_dict_type={state_dict_type}",
            *(f"--config.{k}={v}" for k, v in plan.items()), *extra]
    proc = cli(args, cwd=workdir.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def stop_and_resume(workdir, first: tuple, second: tuple, state_dict_type: str) -> dict:
    """Steps 1-10 at `first` (nproc, plan), 11-20 at `second` from the step-10 checkpoint; the 20 losses."""
    run(workdir, *first, state_dict_type, f"--config.train.stop_at_step={STOP}")
    run(workdir, *second, state_dict_type, "--config.train.resume=true")
    resumed = losses(workdir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    return resumed


TP2 = {"plan.tp_size": 2}


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [((2, TP2), (4, {})), ((2, {}), (4, TP2))],
                         ids=["tp2-to-fsdp4", "fsdp2-to-fsdp2xtp2"])
def test_full_checkpoint_resumes_at_another_mesh(tmp_path, first, second):
    resumed = stop_and_resume(tmp_path / "run", first, second, "FULL_STATE_DICT")
    reference = reference_losses(make_config({}), STEPS)
    assert max_relative_difference([resumed[s] for s in range(1, STEPS + 1)], reference) <= 1e-5


@pytest.mark.slow
def test_sharded_checkpoint_resumes_at_the_same_mesh_bit_exactly(tmp_path):
    run(tmp_path / "straight", 2, TP2, "SHARDED_STATE_DICT")
    resumed = stop_and_resume(tmp_path / "split", (2, TP2), (2, TP2), "SHARDED_STATE_DICT")
    assert resumed == losses(tmp_path / "straight")  # weights, optimizer moments and steps, RNG, data order
