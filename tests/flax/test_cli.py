"""`python -m portable_fsdp.run --backend flax` as a user runs it: the torch backends' metrics and a FULL
checkpoint that plain transformers loads with the same eval_loss."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.e2e.test_training_runs import TRAIN_KEYS, assert_memory_report
from tests.flax.conftest import make_config


def eval_with_transformers(model_dir, config) -> tuple:
    """(eval_loss, token accuracy) of a checkpoint computed by plain transformers over the run's eval batches."""
    from transformers import AutoModelForCausalLM

    from portable_fsdp.data.batch import IGNORE_INDEX

    from portable_fsdp.data.batch import EvalBatches

    from portable_fsdp.data.loader import build_token_data

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    data = build_token_data(config.data, config.model.vocab_size, 1)
    total, tokens, right = 0.0, 0, 0
    with torch.no_grad():
        for batch in EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, config.train.eval_max_batches):
            logits = model(input_ids=torch.from_numpy(batch.input_ids), use_cache=False).logits
            total += F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch.labels).flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += batch.num_label_tokens
            labels = batch.labels != IGNORE_INDEX
            right += int((logits.argmax(-1).numpy() == batch.labels)[labels].sum())
    return total / tokens, right / tokens


def test_flax_command_trains_and_writes_a_checkpoint_transformers_loads(tmp_path):
    proc = cli(["--backend", "flax", "--config", TEST_RECIPE, "--workdir", str(tmp_path),
                "--config.train.compute_metrics=token_accuracy"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path)
    train = [r for r in records if "loss" in r]
    (evaluated,) = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all(TRAIN_KEYS <= set(r) for r in train)
    assert all(len(r["mem_mb"]) == 2 and len(r["state_mb"]) == 2 for r in train)  # one entry per device
    assert_memory_report(records, entries=2)
    assert train[-1]["loss"] < train[0]["loss"]
    checkpoint = tmp_path / "checkpoints" / "step_00000020"
    assert {"model.safetensors", "config.json", "generation_config.json", "optimizer.pt"} <= {
        p.name for p in checkpoint.iterdir()}
    eval_loss, accuracy = eval_with_transformers(checkpoint, make_config())
    assert eval_loss == pytest.approx(evaluated["eval_loss"], rel=1e-5)
    assert evaluated["eval_token_accuracy"] == pytest.approx(accuracy, abs=2 / evaluated["eval_tokens"])  # argmax ties
    assert "flax, 2 rank(s)" in proc.stdout


@pytest.mark.slow
def test_a_sharded_async_run_exports_full_weights_at_the_end(tmp_path):
    """plan.state_dict_type=SHARDED_STATE_DICT, train.async_save and train.export_full_at_end together, as the
    recipes for big models set them: orbax checkpoints, then WORKDIR/export/ that plain transformers loads with the
    run's last eval_loss."""
    proc = cli(["--backend", "flax", "--config", TEST_RECIPE, "--workdir", str(tmp_path), "--config.train.steps=4",
                "--config.train.save_every=2", "--config.plan.state_dict_type=SHARDED_STATE_DICT",
                "--config.train.async_save=true", "--config.train.export_full_at_end=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.strip()], proc.stderr[-3000:]  # orbax says nothing
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == ["step_00000002", "step_00000004"]
    assert all((p / "sharded" / "manifest.ocdbt").is_file() and not (p / "model.safetensors").exists() for p in saved)
    (evaluated,) = [r for r in read_metrics(tmp_path) if "eval_loss" in r]
    eval_loss, _ = eval_with_transformers(tmp_path / "export", make_config())
    assert eval_loss == pytest.approx(evaluated["eval_loss"], rel=1e-5)
    assert ["export", str(tmp_path / "export")] in [line.split() for line in proc.stdout.splitlines()]
