"""The command as users run it: the default job, checkpoints that load outside FSDP, resume, torchrun,
and the local from_pretrained / datasets loading paths."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT, TEST_RECIPE, cli, read_metrics

from portable_fsdp.backend import MEMORY_KEYS

TRAIN_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", *MEMORY_KEYS}


def assert_memory_report(records, entries: int) -> None:
    """The `start` record is exactly the memory report: every key of MEMORY_KEYS, one value per rank/device."""
    (start,) = [r for r in records if r.get("event") == "start"]
    assert set(start) == {"step", "event", *MEMORY_KEYS}
    assert all(len(start[key]) == entries and all(v >= 0 for v in start[key]) for key in MEMORY_KEYS)
    assert all(v > 0 for key in ("mem_mb", "peak_mem_mb", "state_mb", "grad_mb", "base_mem_mb") for v in start[key])


def split(records):
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    return train, evals


# The default job as the README's first command runs it (300 steps, `slow`), and its first 30 steps by default.
@pytest.mark.parametrize("steps", [30, pytest.param(300, marks=pytest.mark.slow)])
def test_default_command_trains_evaluates_and_saves(tmp_path, steps):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    shortened = [] if steps == 300 else [f"--config.train.steps={steps}", f"--config.train.eval_every={steps // 3}"]
    proc = cli(shortened, cwd=tmp_path, timeout=600, env={"TMPDIR": str(temporary)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the launcher's agent files go with the run (torch's default leaves a torchelastic_* directory per run)
    assert not [p.name for p in temporary.iterdir() if p.name.startswith(("torchelastic_", "portable_fsdp-launch-"))]
    (workdir,) = (tmp_path / "runs").iterdir()
    train, evals = split(read_metrics(workdir))
    assert train[-1]["step"] == steps
    assert all(TRAIN_KEYS <= set(r) for r in train)
    assert all(len(r["mem_mb"]) == 2 and len(r["state_mb"]) == 2 for r in train)  # one entry per rank
    assert_memory_report(read_metrics(workdir), entries=2)
    assert train[-1]["loss"] < train[0]["loss"] - (2.0 if steps == 300 else 0.5)  # it learns: ~5.5 -> ~2.4 in 300
    assert [e["step"] for e in evals] == [steps // 3, 2 * steps // 3, steps]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and evals[-1]["eval_tokens"] > 0
    assert (workdir / "checkpoints" / f"step_{steps:08d}" / "model.safetensors").exists()
    assert "eval_loss" in proc.stdout and "checkpoint" in proc.stdout  # the end-of-run summary


def _eval_loss_outside_fsdp(model_dir, overrides):
    """eval_loss of a saved checkpoint computed with plain transformers, over the same eval batches."""
    from transformers import AutoModelForCausalLM

    return eval_loss_of(AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True), overrides)


def eval_loss_of(model, overrides):
    """eval_loss of `model` outside FSDP over the eval batches of the test recipe with `overrides`."""
    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.data.batch import IGNORE_INDEX
    from portable_fsdp.data.batch import EvalBatches
    from portable_fsdp.data.loader import build_token_data

    config = load_recipe(TEST_RECIPE)
    for key, value in overrides.items():
        apply_override(config, key, value)
    data = build_token_data(config.data, config.model.vocab_size, 1)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, config.train.eval_max_batches):
            logits = model(input_ids=torch.from_numpy(batch.input_ids)).logits
            total += F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch.labels).flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += batch.num_label_tokens
    return total / tokens


@pytest.mark.slow  # by default: the FULL export of a SHARDED run, below, is checked the same way
@pytest.mark.parametrize("tied", [False, True])
def test_full_checkpoint_loads_with_from_pretrained(tmp_path, tied):
    overrides = {"model.tie_word_embeddings": str(tied).lower()}
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path)] + [f"--config.{k}={v}" for k, v in overrides.items()],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, evals = split(read_metrics(tmp_path))
    checkpoint = tmp_path / "checkpoints" / "step_00000020"
    assert _eval_loss_outside_fsdp(checkpoint, overrides) == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


# By default FULL resumes bit-exact in test_checkpoint_files.py and after a kill -9 in test_reliability.py, SHARDED
# resharded in test_reliability.py
@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_resume_after_a_stop_gives_the_same_losses(tmp_path, state_dict_type):
    common = ["--config", TEST_RECIPE, "--config.train.log_every=1", f"--config.plan.state_dict_type={state_dict_type}"]
    straight = cli(common + ["--workdir", str(tmp_path / "straight")], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = cli(common + ["--workdir", str(tmp_path / "split"), "--config.train.stop_at_step=10"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = cli(common + ["--workdir", str(tmp_path / "split"), "--config.train.resume=true"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    expected = {r["step"]: r["loss"] for r in split(read_metrics(tmp_path / "straight"))[0]}
    resumed = {r["step"]: r["loss"] for r in split(read_metrics(tmp_path / "split"))[0]}
    assert sorted(resumed) == list(range(1, 21))
    assert resumed == expected  # bit-exact on CPU: weights, optimizer moments and steps, schedule, data order


def test_under_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--log-dir", str(tmp_path / "torchrun"), "-m", "portable_fsdp.run", "--config", TEST_RECIPE, "--workdir", str(tmp_path),
                           "--config.train.steps=5"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, _ = split(read_metrics(tmp_path))
    assert train[-1]["step"] == 5 and len(train[-1]["mem_mb"]) == 2


def test_local_pretrained_model_and_datasets_file(tmp_path):
    """model.init_from = a local save_pretrained directory (loaded on rank 0 only), data from a local
    JSONL file through `datasets`: the first loss is that of the saved weights on the first batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.data.loader import TrainBatches, build_token_data

    torch.manual_seed(123)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
    model.save_pretrained(tmp_path / "model")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "fsdp", "shard", "gather", "scatter"]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"body": " ".join(rng.choice(words, size=30))}) + "\n")
    overrides = {"model.init_from": str(tmp_path / "model"), "data.source": str(tmp_path / "corpus.jsonl"),
                 "data.text_column": "body", "plan.cpu_ram_efficient_loading": "true", "train.steps": "3",
                 "train.log_every": "1"}
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "w")] + [f"--config.{k}={v}" for k, v in overrides.items()],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = load_recipe(TEST_RECIPE)
    for key, value in overrides.items():
        apply_override(config, key, value)
    data = build_token_data(config.data, 300, config.train.batch_size)
    (batch,) = TrainBatches(data.train, config.train.batch_size, 1, config.seed).micro_batches(0, 0, 1)
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(batch.input_ids), labels=None).logits
        expected = F.cross_entropy(expected.flatten(0, 1), torch.from_numpy(batch.labels).flatten()).item()
    train, _ = split(read_metrics(tmp_path / "w"))
    assert train[0]["loss"] == pytest.approx(expected, rel=1e-5)


SHORT = ["--config.train.steps=4", "--config.train.eval_every=0", "--config.train.log_every=1",
         "--config.train.warmup_steps=1"]


def test_sharded_run_exports_full_weights_at_the_end(tmp_path):
    # train.export_full_at_end: the trained model (its eval_loss outside FSDP is the run's last) as
    # from_pretrained loads it, next to the SHARDED checkpoints, without the optimizer state
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path), *SHORT,
                "--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.export_full_at_end=true"],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = tmp_path / "export"
    assert any(line.split() == ["export", str(export)] for line in proc.stdout.splitlines())  # the summary names it
    assert (tmp_path / "checkpoints" / "step_00000004" / "sharded").is_dir()
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["export"] is True
    assert set(manifest["files"]) >= {"config.json", "generation_config.json", "model.safetensors"}
    assert not any(name.startswith(("optimizer", "rng/", "sharded/")) for name in manifest["files"])
    assert not list(tmp_path.glob(".tmp-export"))
    _, evals = split(read_metrics(tmp_path))
    assert _eval_loss_outside_fsdp(export, {}) == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_no_export_after_stop_at_step_but_after_the_resumed_end(tmp_path):
    common = ["--config", TEST_RECIPE, "--workdir", str(tmp_path), *SHORT,
              "--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.export_full_at_end=true"]
    first = cli(common + ["--config.train.stop_at_step=2"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (tmp_path / "export").exists()
    second = cli(common + ["--config.train.resume=true"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["step"] == 4


@pytest.mark.slow
def test_export_with_full_state_dict_is_one_warning(tmp_path):
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path), *SHORT, "--config.train.export_full_at_end=true"],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "export").exists()
    assert sum("export_full_at_end has nothing to do" in line for line in proc.stderr.splitlines()) == 1
