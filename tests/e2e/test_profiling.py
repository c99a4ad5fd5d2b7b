"""train.profile_steps as a user runs it: the trace lands in WORKDIR/profile and names the steps profiled."""
import json

import pytest

from tests.conftest import TEST_RECIPE, cli

PROFILED = ["--config", TEST_RECIPE, "--config.train.steps=4", "--config.train.profile_steps=2,3"]


def test_cpu_trace_names_each_profiled_step(tmp_path):
    proc = cli(PROFILED + ["--workdir", str(tmp_path), "--nproc", "1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" not in proc.stderr  # no kineto noise on a machine without a GPU
    (trace,) = (tmp_path / "profile").glob("rank0.*.pt.trace.json")  # what TensorBoard and Perfetto open
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"step 2", "step 3"} <= names and not {"step 1", "step 4"} & names


@pytest.mark.slow  # a flax run starts jax in two processes (~30 s)
def test_flax_trace_is_written(tmp_path):
    proc = cli(PROFILED + ["--backend", "flax", "--workdir", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))


@pytest.mark.slow  # torch_xla compiles the first steps (~80 s on 2 cores)
def test_xla_trace_is_written(tmp_path):
    from tests.xla.test_cli import ENV

    proc = cli(PROFILED + ["--backend", "xla", "--workdir", str(tmp_path)], cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_profile_steps_outside_the_run_is_one_line_naming_the_field(tmp_path):
    proc = cli(PROFILED[:3] + ["--config.train.profile_steps=3,9", "--workdir", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: train.profile_steps: 3,9 is not a range of steps within 1..4 (train.steps): give FIRST,LAST with "
        "1 <= FIRST <= LAST <= train.steps, e.g. 3,5"]
