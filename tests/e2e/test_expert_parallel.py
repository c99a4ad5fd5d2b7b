"""Expert parallelism from the command line: checkpoints written under plan.ep_size (ep = fsdp 2, or ep = tp 2)
hold the full expert weights (a FULL one resumes without ep, a SHARDED one at the same mesh bit-exactly), a FULL
one written by --backend xla resumes under ep, and a plan the model cannot split is refused at start-up with one
`error:` line (exit 2, nothing written). Training parity under ep, mesh by mesh: tests/dist/test_expert_parallel.py."""
import pytest

from tests.conftest import cli, read_metrics
from tests.parity import families
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

STEPS = 20
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.1)
# 2 ranks: ep = fsdp 2, or ep = tp 2 (fsdp 1, the experts split over the tp pair)
EP_PLANS = [pytest.param({"plan.ep_size": 2}, id="fsdp2_ep2"),
            pytest.param({"plan.ep_size": 2, "plan.tp_size": 2}, id="fsdp1_tp2_ep2")]


def losses_by_step(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def train(model, workdir, tmp_path, nproc: int = 2, **settings):
    """`portable_fsdp.run --backend cpu` on `model` for STEPS steps, every step logged, no evaluation."""
    extra = {"train.steps": STEPS, "train.save_every": 0, **settings}
    proc = cli(["--backend", "cpu", "--nproc", str(nproc), *families.cli_args(model, workdir, extra)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("plan", EP_PLANS)
def test_a_full_checkpoint_written_at_ep2_resumes_at_fsdp2(tmp_path, plan):
    """Written by 2 ranks each holding 2 of the 4 experts: the file holds every expert (the model's own fused
    names, which from_pretrained loads), and 2 ranks without ep (nor tp) continue the run as one process would."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = families.save_model("mixtral", tmp_path / "model", **ROUTER)
    workdir = tmp_path / "run"
    train(model, workdir, tmp_path, **{**plan, "train.stop_at_step": 10})
    checkpoint = workdir / "checkpoints" / "step_00000010"
    weights = load_file(checkpoint / "model.safetensors")
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 320, 64)
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).state_dict()
    assert all(reloaded[name].equal(tensor) for name, tensor in weights.items())
    train(model, workdir, tmp_path, **{"train.resume": "true"})
    resumed = losses_by_step(workdir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    expected = reference_losses(make_config({"model.init_from": str(model)}), STEPS)
    assert max_relative_difference([resumed[s] for s in sorted(resumed)], expected) <= 1e-5


@pytest.mark.slow
def test_a_full_checkpoint_written_on_xla_resumes_at_ep2_on_cpu(tmp_path):
    """--backend xla writes the model's own names too: its FULL checkpoint (no ep) continues on 2 cpu ranks each
    holding 2 of the 4 experts, as one process would."""
    from tests.xla.helpers import XLA_ENV

    model = families.save_model("mixtral", tmp_path / "model")
    workdir = tmp_path / "run"
    args = families.cli_args(model, workdir, {"train.steps": STEPS, "train.save_every": 0, "train.stop_at_step": 10})
    env = {k: v for k, v in XLA_ENV.items() if k != "PJRT_DEVICE"}  # the command chooses the CPU itself
    proc = cli(["--backend", "xla", "--nproc", "2", *args], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train(model, workdir, tmp_path, **{"plan.ep_size": 2, "train.resume": "true"})
    resumed = losses_by_step(workdir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    expected = reference_losses(make_config({"model.init_from": str(model)}), STEPS)
    assert max_relative_difference([resumed[s] for s in sorted(resumed)], expected) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("plan", EP_PLANS)
def test_a_sharded_checkpoint_resumes_at_ep2_bit_exactly(tmp_path, plan):
    model = families.save_model("mixtral", tmp_path / "model", **ROUTER)
    sharded = {**plan, "plan.state_dict_type": "SHARDED_STATE_DICT"}
    train(model, tmp_path / "straight", tmp_path, **sharded)
    train(model, tmp_path / "split", tmp_path, **sharded, **{"train.stop_at_step": 10})
    train(model, tmp_path / "split", tmp_path, **sharded, **{"train.resume": "true"})
    assert losses_by_step(tmp_path / "split") == losses_by_step(tmp_path / "straight")


def refused(capsys, tmp_path, model, nproc: int, extra: dict) -> str:
    """The one stderr line of a run refused at start-up (in-process, as tests/e2e/test_cli_errors.py): exit 2,
    nothing in the workdir."""
    from portable_fsdp import run

    workdir = tmp_path / "run"
    code = run.main(["--backend", "cpu", "--nproc", str(nproc), *families.cli_args(model, workdir, extra)])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(errors) == 1, errors
    assert not any(workdir.rglob("*")), "a refused run wrote into its workdir"
    return errors[0]


def test_experts_that_do_not_split_over_the_ep_ranks_are_refused(capsys, tmp_path):
    model = families.save_model("mixtral", tmp_path / "model", num_local_experts=6)
    assert refused(capsys, tmp_path, model, 4, {"plan.ep_size": 4}) == (
        "error: plan.ep_size: 6 experts per layer do not split over 4 ranks; use e.g. plan.ep_size=2")


def test_ep_on_a_dense_model_is_refused(capsys, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, "llama")
    assert refused(capsys, tmp_path, model, 2, {"plan.ep_size": 2}) == (
        "error: plan.ep_size: 2 needs a mixture-of-experts model; LlamaForCausalLM is dense (no experts to split): "
        "set plan.ep_size=1")


def test_ep_that_leaves_out_tp_ranks_is_refused(capsys, tmp_path, tmp_path_factory):
    """The ep ranks are taken from fsdp × tp, every tp rank included: with tp 2, ep 3 cannot be laid out."""
    model = families.saved(tmp_path_factory, "mixtral")
    assert refused(capsys, tmp_path, model, 4, {"plan.ep_size": 3, "plan.tp_size": 2}) == (
        "error: plan.ep_size: 3 is not a multiple of tp_size=2: the experts are split over ep ranks taken from "
        "fsdp × tp, every tp rank included; use e.g. plan.ep_size=2")
