"""train.report_to as a user runs it: 2 ranks, stopped and resumed; TensorBoard and W&B (offline) hold rank 0's
records of metrics.jsonl at their steps, written once per run, continuing at the resumed step."""
import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.tracker_files import scalar_steps, tensorboard_events, wandb_history


@pytest.mark.slow  # three runs; tests/unit/test_trackers.py checks both trackers' files, a resume included
def test_tensorboard_and_wandb_through_a_stop_and_a_resume(tmp_path):
    workdir = tmp_path / "w"
    common = ["--config", TEST_RECIPE, "--workdir", str(workdir), "--config.train.steps=10",
              "--config.train.eval_every=5", "--config.train.report_to=tensorboard,wandb"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = cli(common + ["--config.train.stop_at_step=5"], cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    second = cli(common + ["--config.train.resume=true"], cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr

    records = read_metrics(workdir)
    losses = [(r["step"], round(r["loss"], 4)) for r in records if "loss" in r]
    assert [step for step, _ in losses] == [5, 10]
    events = tensorboard_events(workdir / "tensorboard")
    assert [(step, round(value, 4)) for step, value in scalar_steps(events, "train/loss")] == losses
    assert [step for step, _ in scalar_steps(events, "eval/loss")] == [5, 10]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "eval/perplexity",
            "train/peak_mem_mb/max", "train/peak_mem_mb/rank_0", "train/peak_mem_mb/rank_1"} <= set(events.Tags()["scalars"])
    assert len(list((workdir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # rank 0 only, once per run

    run_id = (workdir / "wandb_run_id").read_text().strip()
    runs = sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2  # the resumed run continues the same W&B run (one directory per process, rank 0 only)
    logged = [(row["_step"], round(row["train/loss"], 4)) for run in runs for row in wandb_history(run) if "train/loss" in row]
    assert logged == losses
