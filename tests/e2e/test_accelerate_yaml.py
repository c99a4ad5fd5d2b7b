"""`--fsdp_config accelerate.yaml` as `accelerate launch` users mean it: num_processes starts that many workers,
num_machines > 1 joins one rendezvous (two launchers on this machine stand for two machines), refusals are one
`error:` line with nothing written, ignored keys one `warning:` line each."""
import pytest

from benchmarks.common import free_port, run_python
from portable_fsdp import run
from tests.conftest import TEST_RECIPE
from tests.e2e.machines import ARGS, ENV, files, losses, own_lines, records, run_together
from tests.unit.test_accelerate_launch import ACCELERATE_FSDP2, write

@pytest.mark.slow  # the launch keys are unit-tested on the same file (tests/unit/test_accelerate_launch.py)
def test_num_processes_from_the_verbatim_file(tmp_path):
    # The file as `accelerate config` writes it, 2 processes instead of 8, and one key asking for what we don't do.
    path = write(tmp_path, ACCELERATE_FSDP2.replace("num_processes: 8", "num_processes: 2"), debug="true")
    proc = run_python([*ARGS, "--fsdp_config", path, "--workdir", str(tmp_path / "run")], 300, ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:") or "Warning" in line]
    assert warned == [f"warning: {path}: debug is ignored: portable_fsdp has no debug launch mode; set "
                      "TORCH_DISTRIBUTED_DEBUG=DETAIL for torch's checks"]
    assert "cpu, 2 rank(s)" in proc.stdout
    assert all(len(r["mem_mb"]) == 2 for r in records(tmp_path / "run") if "loss" in r)  # one entry per rank


def run_two_machines(tmp_path, args: list, shared) -> list:
    """Two launchers, machine_rank 0 and 1 of num_machines 2 (a static rendezvous at 127.0.0.1), each with its
    own copy of the YAML and the same --workdir (as two machines share a disk); both must exit 0. Returns their
    (stdout, stderr)."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        (tmp_path / f"machine{rank}").mkdir()
        nodes.append(write(tmp_path / f"machine{rank}", num_processes=2, num_machines=2, machine_rank=rank,
                           mixed_precision="'no'", main_process_ip="127.0.0.1", main_process_port=port))
    return run_together([([*args, "--fsdp_config", node, "--workdir", str(shared)], None) for node in nodes])


@pytest.mark.slow  # several machines on one: tests/e2e/test_slurm.py in the default suite
def test_two_machines_match_one(tmp_path):
    """machine_rank 0 and 1 of num_machines 2 (static rendezvous at 127.0.0.1), sharing one workdir as two
    machines share a disk: the losses of `--nproc 2` on one machine, bit for bit; rank 0 alone writes metrics."""
    shared = tmp_path / "shared"
    outputs = run_two_machines(tmp_path, ARGS, shared)
    assert "cpu, 2 rank(s)" in outputs[0][0]
    assert own_lines(outputs[1][0]) == []  # machine 1 prints no summary
    one = tmp_path / "one"
    single = write(tmp_path, num_processes=2, mixed_precision="'no'")
    proc = run_python([*ARGS, "--fsdp_config", single, "--workdir", str(one)], 300, ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(one)) == 6
    assert losses(shared) == losses(one)  # measured: identical, not merely within 1e-6
    assert [sorted(r) for r in records(shared)] == [sorted(r) for r in records(one)]  # rank 0 wrote each record once
    assert files(shared) == files(one)  # the same checkpoint: both machines' rank files, one commit


@pytest.mark.slow  # three flax runs; two machines are exercised by default on the torch backend above
def test_flax_on_two_machines_matches_one(tmp_path):
    """--backend flax with num_machines 2: each machine's launcher is one JAX process (jax.distributed, gloo
    between host CPU devices) driving num_processes / num_machines = 1 device of a 2-device mesh, reading its
    own rows of the batch. The losses, grad norms and eval results (predictions gathered from both) of one process
    driving 2 devices (`--nproc 2`), within 1e-6 relative (measured: identical); machine 0 alone writes metrics
    and the FULL checkpoint, of the same weights."""
    args = [*ARGS, "--backend", "flax", "--config.train.compute_metrics=token_accuracy"]
    shared = tmp_path / "shared"
    outputs = run_two_machines(tmp_path, args, shared)
    assert "flax, 2 rank(s)" in outputs[0][0] and own_lines(outputs[1][0]) == []  # machine 1 prints no summary
    one = tmp_path / "one"
    single = write(tmp_path, num_processes=2, mixed_precision="'no'")
    proc = run_python([*args, "--nproc", "2", "--fsdp_config", single, "--workdir", str(one)], 300, ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(one)) == 6 and [s for s, *_ in losses(shared)] == [s for s, *_ in losses(one)]
    for (_, loss, grad_norm), (_, want_loss, want_norm) in zip(losses(shared), losses(one)):
        assert loss == pytest.approx(want_loss, rel=1e-6) and grad_norm == pytest.approx(want_norm, rel=1e-6)
    evals = [[(r["eval_loss"], r["eval_tokens"], r["eval_token_accuracy"]) for r in records(w) if "eval_loss" in r]
             for w in (shared, one)]
    assert len(evals[1]) == 1 and evals[0][0] == pytest.approx(evals[1][0], rel=1e-6)
    assert [sorted(r) for r in records(shared)] == [sorted(r) for r in records(one)]  # machine 0 wrote each once
    assert all(len(r["mem_mb"]) == 1 for r in records(shared) if "mem_mb" in r)  # machine 0's one device
    assert files(shared) == files(one)  # one FULL checkpoint, written by machine 0
    weights = [w / "checkpoints" / "step_00000006" / "model.safetensors" for w in (shared, one)]
    assert weights[0].read_bytes() == weights[1].read_bytes()  # gathered whole from both machines


def run_main(capsys, *args):
    code = run.main(["--config", TEST_RECIPE, *args])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("changes, backend, message", [
    ({"distributed_type": "DEEPSPEED"}, "auto",
     "distributed_type: DEEPSPEED is not run by portable_fsdp; write distributed_type: FSDP (with the fsdp_config "
     "section), or XLA for torch_xla"),
    ({"num_processes": 3, "num_machines": 2, "main_process_ip": "127.0.0.1"}, "auto",
     "num_processes: 3 processes do not divide over num_machines = 2 (Accelerate counts the processes of all "
     "machines); set num_processes to a multiple of num_machines"),
    ({"num_machines": 2, "main_process_ip": "127.0.0.1", "rdzv_backend": "c10d"}, "flax",
     "rdzv_backend: c10d: --backend flax joins jax.distributed with machine_rank as the process id, which c10d "
     "does not keep; write rdzv_backend: static"),
])
def test_refused_before_anything_is_written(tmp_path, capsys, changes, backend, message):
    path = write(tmp_path, **changes)
    workdir = tmp_path / "run"
    code, err = run_main(capsys, "--fsdp_config", path, "--backend", backend, "--workdir", str(workdir))
    assert (code, err) == (2, [f"error: {path}: {message}"])
    assert not workdir.exists()


def test_several_machines_need_a_workdir(tmp_path, capsys):
    path = write(tmp_path, num_machines=2, main_process_ip="127.0.0.1")
    code, err = run_main(capsys, "--fsdp_config", path)
    assert (code, err) == (2, ["error: --workdir: num_machines: 2 needs --workdir, one directory every machine "
                               "writes to (gs://bucket/run, or a shared mount): checkpoints hold every machine's files"])
