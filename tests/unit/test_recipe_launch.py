"""A recipe variant names the machine it is sized for: `run` and `estimate` launch on it unless told otherwise."""
import pytest

from portable_fsdp import run
from portable_fsdp.configs.hardware import launch_flags
from portable_fsdp.errors import Notice, UserError
from portable_fsdp.estimate import __main__ as estimate_cli
from portable_fsdp.launch import launcher


def test_unset_flags_come_from_the_variant():
    assert launch_flags("llama3_8b:8xh100", backend="auto", device="auto", nproc=None) == ("cuda", "h100", 8)
    assert launch_flags("qwen3_30b_a3b:v5p-16", backend="auto", nproc=None) == ("xla", 8)
    assert launch_flags("llama3_8b:smoke", backend="auto", nproc=None) == ("cpu", 2)


@pytest.mark.parametrize("spec", [None, "llama3_8b", "llama_tiny:anything"])
def test_a_spec_without_a_variant_leaves_the_flags_alone(spec):
    assert launch_flags(spec, backend="auto", nproc=None) == ("auto", None)


def test_a_flag_that_differs_from_the_variant_wins_with_one_notice():
    with pytest.warns(Notice) as caught:
        assert launch_flags("llama3_8b:8xh100", backend="cuda", device="a100", nproc=8) == ("cuda", "a100", 8)
    assert [str(w.message) for w in caught] == [
        "--device a100 is used, not the h100 that variant 8xh100 is sized for"]


def test_the_smoke_variant_runs_on_any_backend_without_a_notice(recwarn):
    assert launch_flags("llama3_8b:smoke", backend="flax", nproc=None) == ("flax", 2)
    assert not recwarn.list


def test_estimate_of_a_variant_targets_its_machine(monkeypatch):
    chosen = {}

    def stop_at_the_target(backend, device, nproc):
        chosen.update(backend=backend, device=device, nproc=nproc)
        raise UserError("target", "chosen")

    monkeypatch.setattr(estimate_cli, "resolve_target", stop_at_the_target)
    assert estimate_cli.main(["--config", "llama3_8b:8xh100"]) == 2
    assert chosen == {"backend": "cuda", "device": "h100", "nproc": 8}


def test_run_of_a_variant_launches_its_backend_and_processes(monkeypatch, tmp_path):
    launched = {}
    monkeypatch.setattr(launcher, "start", lambda config, backend, workdir, nproc, nodes: launched.update(
        backend=backend, nproc=nproc))
    assert run.main(["--config", "llama3_8b:v5p-8", "--workdir", str(tmp_path)]) == 0
    assert launched == {"backend": "xla", "nproc": 4}


@pytest.mark.slow  # 25 s: the estimator process traces the smoke model
def test_the_smoke_variant_is_estimated_on_its_two_host_ranks(capsys):
    assert estimate_cli.main(["--config", "llama3_8b:smoke"]) == 0
    assert "shared by 2 ranks" in capsys.readouterr().out
