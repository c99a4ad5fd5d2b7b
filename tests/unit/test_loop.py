"""The neutral loop with a scripted backend: early stopping, best-model bookkeeping, stop_at_step, resume."""
import dataclasses
import json
import pathlib
import re
import threading
import time

import pytest

from portable_fsdp.checkpoint import layout as checkpointing

from portable_fsdp.training import loop
from portable_fsdp.config.schema import apply_override, load_recipe
from portable_fsdp.backend import MEMORY_KEYS, ModelInfo, Placement
from portable_fsdp.config.validate import resolve_plan
from tests.unit._helpers import user_error


@dataclasses.dataclass
class State:
    step: int
    weights_from: int = 0  # the step whose "weights" the state holds


class ScriptedBackend:
    """Implements the backend surface; eval_loss follows a script indexed by evaluation number."""

    def __init__(self, eval_losses):
        self.eval_losses = list(eval_losses)
        self.evals = 0
        self.loaded = []

    def init(self, config, plan, name, parts):
        return State(step=0)

    def placement(self, state):
        return Placement(rank=0, world_size=1, dp_rank=0, dp_size=1)

    def model_info(self, state):
        return ModelInfo((), (), 1000, 2, 64, 384)

    def device_kind(self, state):
        return "cpu"

    def time_matmul(self, state, size, dtype):
        return 2.0 * size**3 / 1e9  # a 1 GFLOP/s device

    def train_step(self, state, micro_batches):
        return State(state.step + 1, state.step + 1), {"loss": 1.0, "tokens": 10, "grad_norm": 0.5, "lr": 1e-3}

    def memory_report(self, state):
        return {key: [1.0] for key in MEMORY_KEYS}

    def count_label_tokens(self, state, batch):
        return 1

    def eval_step(self, state, batch, num_items_in_batch):  # one batch per evaluation (eval_max_batches=1)
        self.evals += 1
        return {"loss_sum": self.eval_losses[self.evals - 1]}

    def predict_step(self, state, batch):
        raise AssertionError("no compute_metrics configured")

    def barrier(self, state, timeout_s=None):
        pass

    def any_rank(self, state, flag):
        return flag

    def save_checkpoint(self, state, directory):
        pathlib.Path(directory, "weights.json").write_text(json.dumps({"step": state.weights_from}))

    def load_checkpoint(self, state, directory, manifest):
        self.loaded.append(pathlib.Path(directory).name)
        return State(manifest["step"], json.loads(pathlib.Path(directory, "weights.json").read_text())["step"])

    def finalize(self, state):
        pass


def run(tmp_path, backend, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = load_recipe("llama_tiny:test")
    overrides = {"eval_max_batches": 1, "eval_batch_size": 1, "log_every": 1, **train}
    for key, value in overrides.items():
        apply_override(config, f"train.{key}", str(value).lower())
    return loop.run(config, resolve_plan(config, 1), backend, "cpu", tmp_path)


def evals(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]


def test_early_stopping_after_patience_evals_without_improvement(tmp_path):
    backend = ScriptedBackend([3.0, 2.0, 2.5, 2.1, 1.0, 0.5])
    result = run(tmp_path, backend, steps=12, eval_every=2, early_stopping_patience=2)
    assert [e["step"] for e in evals(tmp_path)] == [2, 4, 6, 8]  # 2.5 and 2.1 do not beat 2.0: stop at 8
    assert "early stopping" in result["stopped"]
    assert checkpointing.latest(tmp_path).name == "step_00000008"  # stopping saves a checkpoint


def test_load_best_model_at_end_keeps_and_loads_the_best(tmp_path):
    backend = ScriptedBackend([3.0, 1.0, 2.0, 2.5, 2.6])
    result = run(tmp_path, backend, steps=10, eval_every=2, load_best_model_at_end=True, keep_last_n=1)
    assert checkpointing.best(tmp_path).name == "step_00000004"
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()  # pruning spares the best
    assert (tmp_path / "checkpoints" / "step_00000010").is_dir()
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()
    assert backend.loaded == ["step_00000004"]
    assert "step 4, eval_loss 1.0000" in result["best model"]


def test_stop_at_step_then_resume_continues_where_it_stopped(tmp_path):
    first = run(tmp_path, ScriptedBackend([1.0] * 5), steps=10, eval_every=5, stop_at_step=4)
    assert first["stopped"] == "train.stop_at_step=4"
    resumed_backend = ScriptedBackend([1.0] * 5)
    run(tmp_path, resumed_backend, steps=10, eval_every=5, resume=True)
    assert resumed_backend.loaded == ["step_00000004"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 11))


def test_resume_with_nothing_to_resume_says_so_and_starts_from_step_0(tmp_path, capsys):
    backend = ScriptedBackend([1.0])
    run(tmp_path, backend, steps=2, eval_every=0, resume=True)
    assert backend.loaded == []
    assert capsys.readouterr().err.splitlines() == [
        f"warning: train.resume=true but {tmp_path} holds no checkpoint to resume from; starting from step 0"]


def test_the_best_eval_loss_survives_a_resume(tmp_path):
    run(tmp_path, ScriptedBackend([1.0, 2.0]), steps=8, eval_every=2, load_best_model_at_end=True, stop_at_step=4)
    assert checkpointing.best(tmp_path).name == "step_00000002"
    resumed = ScriptedBackend([3.0, 4.0])  # worse than the 1.0 seen before the stop
    result = run(tmp_path, resumed, steps=8, eval_every=2, load_best_model_at_end=True, resume=True)
    assert checkpointing.best(tmp_path).name == "step_00000002"
    assert resumed.loaded == ["step_00000004", "step_00000002"]  # resume, then the best at the end
    assert "step 2, eval_loss 1.0000" in result["best model"]


def test_checkpoints_are_marked_best_only_when_asked(tmp_path):
    run(tmp_path, ScriptedBackend([3.0, 1.0]), steps=4, eval_every=2)
    assert checkpointing.best(tmp_path) is None


class SlowLoggingBackend(ScriptedBackend):
    """train_step takes ~20 ms and every memory report (made for each log record) ~10 ms."""

    def train_step(self, state, micro_batches):
        time.sleep(0.02)
        return super().train_step(state, micro_batches)

    def memory_report(self, state):
        time.sleep(0.01)
        return super().memory_report(state)


def end_record(tmp_path):
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("event") == "end")


def test_the_time_logging_takes_is_measured_against_the_step_time(tmp_path):
    result = run(tmp_path / "every", SlowLoggingBackend([1.0]), steps=10, eval_every=0, log_every=1)
    every = end_record(tmp_path / "every")["bookkeeping_fraction"]
    assert 0.3 <= every <= 1.0  # ~10 ms of logging per ~20 ms step
    assert "% of step time" in result["logging overhead"]
    run(tmp_path / "rare", SlowLoggingBackend([1.0]), steps=10, eval_every=0, log_every=100)
    assert end_record(tmp_path / "rare")["bookkeeping_fraction"] < 0.2  # one record, at the last step


class LoadingBackend(ScriptedBackend):
    """A resume's load that can fail: `load_error` is raised after the checkpoint's weights.json is read."""

    def __init__(self, load_error=None, rank=0, world_size=1):
        super().__init__([1.0] * 5)
        self.load_error, self.rank, self.world_size = load_error, rank, world_size
        self.loading = threading.Event()

    def placement(self, state):
        return Placement(rank=self.rank, world_size=self.world_size, dp_rank=self.rank, dp_size=self.world_size)

    def load_checkpoint(self, state, directory, manifest):
        self.loading.set()
        loaded = super().load_checkpoint(state, directory, manifest)
        if self.load_error:
            raise self.load_error
        return loaded


def stopped_at_4(tmp_path):
    run(tmp_path, ScriptedBackend([1.0] * 5), steps=10, eval_every=5, stop_at_step=4)
    return checkpointing.latest(tmp_path) / "weights.json"


def train_steps(tmp_path):
    return [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_the_checksums_are_verified_while_the_checkpoint_loads(tmp_path, monkeypatch):
    stopped_at_4(tmp_path)
    backend, verify = LoadingBackend(), checkpointing.verify_checksums

    def verify_once_loading(*args):  # a verification made before the load would wait here in vain
        assert backend.loading.wait(timeout=30), "the checksums were verified before the load began"
        return verify(*args)

    monkeypatch.setattr(checkpointing, "verify_checksums", verify_once_loading)
    run(tmp_path, backend, steps=10, eval_every=5, resume=True)
    assert backend.loaded == ["step_00000004"] and train_steps(tmp_path) == list(range(1, 11))


def test_a_mismatch_found_while_loading_stops_the_resume_before_any_step(tmp_path):
    weights = stopped_at_4(tmp_path)
    weights.write_text(weights.read_text().replace("4", "3"))  # same size, loads fine: only the checksum tells
    backend = LoadingBackend()
    with user_error("train.resume", "weights.json does not match its checksum"):
        run(tmp_path, backend, steps=10, eval_every=5, resume=True)
    assert backend.loaded == ["step_00000004"] and train_steps(tmp_path) == [1, 2, 3, 4]


def test_a_load_failing_on_bytes_another_rank_verifies_names_the_corrupt_file(tmp_path, monkeypatch):
    """The damaged file is in the other rank's share: the rank whose load failed checks every byte itself."""
    weights = stopped_at_4(tmp_path)
    weights.write_text(weights.read_text().replace("{", "x"))
    share = checkpointing.verify_share
    monkeypatch.setattr(checkpointing, "verify_share",
                        lambda manifest, rank, world_size: share(manifest, rank, world_size) if world_size == 1 else [])
    backend = LoadingBackend(rank=1, world_size=2)
    with user_error("train.resume", "weights.json does not match its checksum"):
        run(tmp_path, backend, steps=10, eval_every=5, resume=True)


def test_a_load_error_of_an_intact_checkpoint_is_raised_as_it_is(tmp_path):
    stopped_at_4(tmp_path)
    with pytest.raises(MemoryError, match="no room for the optimizer state"):
        run(tmp_path, LoadingBackend(MemoryError("no room for the optimizer state")), steps=10, eval_every=5, resume=True)


class LogitsBackend(ScriptedBackend):
    """Gives logits to a compute_metrics of Hugging Face Trainer's convention; records the preprocess function."""

    def __init__(self, eval_losses):
        super().__init__(eval_losses)
        self.preprocess = []

    def predict_step(self, state, batch, return_logits=False, preprocess_logits=None):
        import numpy as np

        self.preprocess.append(preprocess_logits)
        logits = np.zeros((*batch.input_ids.shape, 4), np.float32)
        out = preprocess_logits(logits, batch.labels) if preprocess_logits else logits
        return {"predictions": logits.argmax(-1), "labels": batch.labels, "logits": out}


def test_trainer_compute_metrics_gets_the_configured_preprocess(tmp_path):
    from tests.unit import test_eval_prediction as functions

    backend = LogitsBackend([1.0, 1.0])
    run(tmp_path, backend, steps=4, eval_every=2,
        compute_metrics="tests.unit.test_eval_prediction:keep_eval_prediction",
        preprocess_logits_for_metrics="tests.unit.test_eval_prediction:argmax")
    assert [e["eval_rows"] for e in evals(tmp_path)] == [1, 1]
    assert backend.preprocess == [functions.argmax] * 2


def test_a_run_outside_a_terminal_prints_one_key_value_line_per_logged_step(tmp_path, capsys):
    run(tmp_path, ScriptedBackend([1.0]), steps=6, eval_every=0, log_every=3, progress_bar=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2  # steps 3 and 6 only, no bar redraws
    assert re.fullmatch(r"step 3/6 loss=1\.0000 grad_norm=0\.500 lr=1\.0e-03 tok/s=\d+ mfu=\d+\.\d% mem=1MiB "
                        r"eta=\d+:\d\d:\d\d", lines[0]), lines[0]
    assert lines[1].startswith("step 6/6 ") and lines[1].endswith(" eta=0:00:00")


def test_progress_bar_false_prints_no_step_lines(tmp_path, capsys):
    run(tmp_path, ScriptedBackend([1.0]), steps=2, eval_every=0, progress_bar=False)
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_rank_0_prints_what_the_run_is_before_its_first_step(tmp_path, capsys):
    run(tmp_path, ScriptedBackend([1.0]), steps=2, eval_every=0)
    head = capsys.readouterr().out.splitlines()[:8]
    assert [line.split()[0] for line in head] == ["model", "backend", "devices", "mesh", "precision", "data", "steps",
                                                  "workdir"]
    assert head[0].split(None, 1)[1] == "llama, 0.00M parameters, 2 layers, hidden 64, vocab 384"
    assert head[1].split(None, 1)[1] == "cpu, 1 rank(s) in 1 process(es)"
    assert head[4].split(None, 1)[1] == "compute float32, gradient reduction float32"
    assert head[7].split(None, 1)[1] == str(tmp_path)
