"""The Python API as the README shows it: its custom-loop example runs as written, in a single process without
torchrun, and `train(...)` returns the run's summary (in this process, and rank 0's from 2 processes)."""
import json
import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def readme_example() -> str:
    """The first python block of the README's "Python API" section, exactly as written there."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Python API\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Python API' section"
    block = re.search(r"^```python\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "the README's Python API section has no ```python block"
    return block.group(1)


def python(code: str, cwd, timeout=300):
    # in a directory of its own: the example writes runs/ where it runs
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_readme_custom_loop_runs_as_written(tmp_path):
    code = readme_example()
    assert len(code.splitlines()) <= 30
    assert "loss=loss" in code and "optimizer=" in code  # the example shows a loss and an optimizer of one's own
    proc = python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if re.fullmatch(r"\d+ \d+\.\d+ lr=\S+", line)]
    losses = [float(line[1]) for line in lines]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert [line[2] for line in lines[:4]] == ["lr=0.017", "lr=0.033", "lr=0.050", "lr=0.050"]  # the schedule's
    assert "'eval_loss'" in proc.stdout
    assert (tmp_path / "runs" / "my-loop" / "checkpoints" / "step_00000010" / "manifest.json").exists()
    assert "[Gloo]" not in proc.stdout + proc.stderr


TRAIN = """
import json, os
import portable_fsdp as pf

config = pf.get_config("llama_tiny:test", {"train.steps": 4, "train.log_every": 2})
results = {}
for nproc in (1, 2):
    summary = pf.train(config, backend="cpu", workdir=f"w{nproc}", nproc=nproc)
    results[nproc] = {"summary": summary, "env_left": "WORLD_SIZE" in os.environ}
try:
    pf.train(pf.get_config("llama_tiny:test"), workdir="w1")  # holds checkpoints: refused, as by the command
except pf.api.UserError as err:
    results["refused"] = err.field
print(json.dumps(results))
"""


def test_train_returns_the_summary(tmp_path):
    proc = python(TRAIN, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for nproc in ("1", "2"):
        summary = results[nproc]["summary"]
        assert summary["backend"] == f"cpu, {nproc} rank(s)"
        assert summary["steps"].startswith("0 -> 4 in ")
        assert summary["checkpoint"] == f"w{nproc}/checkpoints/step_00000004"
        assert "eval_loss" in summary and "loss" in summary
        assert not results[nproc]["env_left"]  # an in-process run leaves the environment as it found it
    assert results["refused"] == "--workdir"


CALLBACKS = """
import json, pathlib
import portable_fsdp as pf

class Recorder:
    def __init__(self):
        self.steps, self.evals, self.saves = [], [], []

    def on_step(self, state, metrics):
        self.steps.append((metrics["step"], metrics["loss"]))

    def on_eval(self, state, metrics):
        self.evals.append(metrics["step"])

    def on_save(self, state, path):
        self.saves.append(str(path))

config = pf.get_config("llama_tiny:test", {"train.steps": 8, "train.eval_every": 1, "train.eval_max_batches": 1})
recorder = Recorder()
# no evaluation improves on the first by 1e9: the third one stops the run
summary = pf.train(config, backend="cpu", workdir="w", callbacks=[recorder, pf.EarlyStopping(patience=2, min_delta=1e9)])
print(json.dumps({"summary": summary, "steps": recorder.steps, "evals": recorder.evals, "saves": recorder.saves}))
"""


def test_callbacks_see_each_step_and_early_stopping_ends_the_run_with_a_checkpoint(tmp_path):
    proc = python(CALLBACKS, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [step for step, _ in result["steps"]] == [1, 2, 3] and all(loss > 0 for _, loss in result["steps"])
    assert result["evals"] == [1, 2, 3]
    assert result["summary"]["stopped"] == "early stopping: no better eval_loss in 2 evals"
    assert result["saves"] == ["w/checkpoints/step_00000003"]
    assert (tmp_path / "w" / "checkpoints" / "step_00000003" / "manifest.json").exists()


OWN_PARTS = """
import json
import torch
import portable_fsdp as pf
from examples.custom_model.torch_mlp import MLPLanguageModel, token_mean_loss

def run(steps, resume):
    config = pf.get_config("llama_tiny:test", {"train.steps": steps, "train.log_every": 1, "train.save_every": 2,
                                               "train.eval_every": 2, "train.resume": resume})
    with torch.device("meta"):
        model = MLPLanguageModel(vocab_size=config.model.vocab_size)
    return pf.train(config, backend="cpu", workdir="w", model=model, loss=token_mean_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=1.0, momentum=0.9),
                    schedule=lambda step: 0.1 / (1 + step))

print(json.dumps([run(4, False), run(6, True)]))
"""


def test_train_takes_a_users_model_loss_optimizer_and_schedule_and_resumes(tmp_path):
    proc = python(OWN_PARTS, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["steps"].startswith("0 -> 4") and resumed["steps"].startswith("4 -> 6")
    steps = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in steps if "lr" in r}
    assert lrs == {step: 0.1 / step for step in range(1, 7)}  # metrics of step s: the update made at step s - 1
    assert any("eval_loss" in r for r in steps)
    checkpoint = tmp_path / "w" / "checkpoints" / "step_00000004"
    assert (checkpoint / "model.safetensors").exists() and not (checkpoint / "config.json").exists()
