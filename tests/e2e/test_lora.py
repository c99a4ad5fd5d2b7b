"""LoRA fine-tuning (model.peft) as users run it: checkpoints hold the adapters alone in peft's files, which
`PeftModel.from_pretrained` loads onto the base; a resume gives the uninterrupted run's losses bit for bit; the
export is the base with the adapters merged in."""
import json

import pytest
import torch

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.e2e.test_training_runs import eval_loss_of, split

peft = pytest.importorskip("peft")

LORA = {"model.peft.type": "lora", "model.peft.r": "4", "model.peft.target_modules": "q_proj,v_proj,down_proj"}
COMMON = ["--config", TEST_RECIPE, "--config.train.steps=6", "--config.train.log_every=1",
          *[f"--config.{k}={v}" for k, v in LORA.items()]]


def train(workdir, *extra):
    proc = cli([*COMMON, "--workdir", str(workdir), *extra], cwd=workdir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in split(read_metrics(workdir))[0]}


def resumed_losses(tmp_path, *extra) -> tuple:
    """(the uninterrupted run's losses, those of a run stopped at step 3 and resumed) with `extra` settings."""
    train(tmp_path / "straight", *extra)
    train(tmp_path / "split", "--config.train.stop_at_step=3", *extra)
    train(tmp_path / "split", "--config.train.resume=true", *extra)
    return losses(tmp_path / "straight"), losses(tmp_path / "split")


def base_model():
    """The frozen base the runs adapt: the test recipe's seeded random init."""
    from portable_fsdp.backends.hf_torch.model import create_model
    from tests.parity.matrix import make_config

    return create_model(make_config({}), rank=0, rank0_only=False).eval()


def load_adapters(checkpoint):
    from peft import PeftModel

    from portable_fsdp.backends.hf_torch.adapters import tolerating_old_torchao

    with tolerating_old_torchao():
        return PeftModel.from_pretrained(base_model(), str(checkpoint)).eval()


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lora")
    straight, resumed = resumed_losses(tmp_path, "--config.train.export_full_at_end=true")
    return tmp_path / "straight", straight, resumed


def test_full_resume_gives_the_same_losses(full_runs):
    _, straight, resumed = full_runs
    assert sorted(resumed) == list(range(1, 7))
    assert resumed == straight


def test_checkpoint_is_peft_adapters_that_load_onto_the_base(full_runs):
    workdir, _, _ = full_runs
    checkpoint = workdir / "checkpoints" / "step_00000006"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= set(manifest["files"])
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in manifest["files"])
    assert manifest["base_weights"].startswith("random init")
    adapted = load_adapters(checkpoint)
    _, evals = split(read_metrics(workdir))
    assert eval_loss_of(adapted, {}) == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


def test_export_is_the_merged_model(full_runs):
    from transformers import AutoModelForCausalLM

    workdir, _, _ = full_runs
    merged = AutoModelForCausalLM.from_pretrained(workdir / "export", local_files_only=True).eval()
    adapted = load_adapters(workdir / "checkpoints" / "step_00000006")
    input_ids = torch.arange(48).reshape(2, 24) % merged.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, adapted(input_ids=input_ids).logits,
                                   rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base_model()(input_ids=input_ids).logits, merged(input_ids=input_ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_sharded_resume_gives_the_same_losses_and_peft_files(tmp_path, async_save):
    straight, resumed = resumed_losses(tmp_path, "--config.plan.state_dict_type=SHARDED_STATE_DICT",
                                       f"--config.train.async_save={async_save}")
    assert resumed == straight
    checkpoint = tmp_path / "split" / "checkpoints" / "step_00000006"
    assert (checkpoint / "sharded").is_dir() and (checkpoint / "adapter_model.safetensors").exists()
    _, evals = split(read_metrics(tmp_path / "split"))
    assert eval_loss_of(load_adapters(checkpoint), {}) == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


def test_estimate_gives_gradients_and_optimizer_state_to_the_adapters_only():
    from portable_fsdp import estimate
    from tests.parity.matrix import make_config

    with estimate.Estimator() as estimator:
        full, lora = (estimate.estimate_config(make_config(overrides), estimate.resolve_target("cpu", "cpu", 2), [0],
                                               estimator).result["ranks"][0] for overrides in ({}, LORA))
    n_params, float32 = 135_488, 4
    # r x (in + out) per adapted Linear of each of the 2 layers: q_proj 64 -> 64, v_proj 64 -> 32, down_proj 160 -> 64
    n_adapter = 2 * 4 * ((64 + 64) + (64 + 32) + (160 + 64))
    assert lora["held"]["gradients"] == n_adapter * float32 // 2
    assert lora["held"]["optimizer"] - 2 * n_adapter * float32 // 2 in range(0, 128)  # + AdamW's step counters
    assert lora["held"]["parameters"] - (n_params + n_adapter) * float32 // 2 in range(0, 129)
    frozen_state = 3 * n_params * float32 // 2  # the base's gradients and AdamW moments, per rank
    saved = sum(full["held"][k] - lora["held"][k] for k in ("gradients", "optimizer"))
    assert saved == pytest.approx(frozen_state, rel=0.05)
    assert full["peak"] - lora["peak"] > 0.5 * frozen_state


def readme_command() -> list:
    """The arguments of the README's LoRA command (`portable-fsdp run ARGS`)."""
    from tests.conftest import ROOT

    section = (ROOT / "README.md").read_text().split("### LoRA fine-tuning (`model.peft`)", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    words = command.split()
    assert words[:2] == ["portable-fsdp", "run"], command  # `portable-fsdp run` is `python -m portable_fsdp.run`
    return words[2:]


def test_the_readme_lora_command_runs_as_written(tmp_path):
    # as written, in tmp_path (its workdir is relative), but for a few steps and no evaluation before the end
    proc = cli([*readme_command(), "--config.train.steps=3", "--config.train.eval_every=0",
                "--config.train.eval_max_batches=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (checkpoint,) = (tmp_path / "runs" / "lora" / "checkpoints").glob("step_*")
    assert (checkpoint / "adapter_model.safetensors").exists()
    assert json.loads((checkpoint / "adapter_config.json").read_text())["r"] == 8
