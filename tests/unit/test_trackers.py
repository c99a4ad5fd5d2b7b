"""train.report_to: which trackers a value names, the refusal of one that is not installed (before anything is
written), the scalars a record becomes, and what TensorBoard and W&B (offline) hold afterwards."""
import sys

import pytest

from portable_fsdp import run

from portable_fsdp.training import trackers
from portable_fsdp.config.schema import apply_override, load_recipe
from tests.conftest import TEST_RECIPE
from tests.tracker_files import scalar_steps, tensorboard_events, wandb_config, wandb_history, wandb_records
from tests.unit._helpers import user_error

RECORDS = [
    {"step": 0, "event": "start", "peak_mem_mb": [100.0, 110.0], "mem_mb": [90.0, 95.0]},
    {"step": 5, "loss": 5.5, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_sec": 1000.0, "mfu": 0.01, "epoch": 0,
     "peak_mem_mb": [120.0, 130.0]},
    {"step": 10, "loss": 4.5, "lr": 2e-3, "grad_norm": 1.5, "tokens_per_sec": 1100.0, "mfu": 0.011, "epoch": 0,
     "peak_mem_mb": [121.0, 131.0]},
    {"step": 10, "eval_loss": 4.4, "eval_tokens": 512, "perplexity": 81.45},
]


def config_with(**train):
    config = load_recipe(TEST_RECIPE)
    for key, value in train.items():
        apply_override(config, f"train.{key}", str(value))
    return config


@pytest.mark.parametrize("value,expected", [
    ("none", []), ("", []), ("None", []), ("tensorboard", ["tensorboard"]), ("wandb", ["wandb"]),
    ("tensorboard,wandb", ["tensorboard", "wandb"]), (" wandb , tensorboard ", ["wandb", "tensorboard"]),
    ("tensorboard,tensorboard", ["tensorboard"]), (["tensorboard", "wandb"], ["tensorboard", "wandb"]),
    ("all", ["tensorboard", "wandb"]),
])
def test_resolve(value, expected):
    assert trackers.resolve(value) == expected


def test_all_means_the_installed_ones(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    assert trackers.resolve("all") == ["tensorboard"]
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert trackers.resolve("all") == []  # as Hugging Face: nothing to report to is no error


def test_unknown_tracker():
    with user_error("train.report_to", "unknown tracker 'mlflow'; choose none, all, tensorboard, wandb"):
        trackers.resolve("tensorboard,mlflow")


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_tracker_is_one_line_before_anything_is_written(capsys, tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # the import fails as if the package were not installed
    workdir = tmp_path / "w"
    code = run.main(["--config", TEST_RECIPE, "--workdir", str(workdir), f"--config.train.report_to={name}"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: train.report_to: {name} is not installed; pip install {name} (or leave {name} out of "
        "train.report_to)"]
    assert not workdir.exists()


def test_scalars_of_a_record():
    assert trackers.scalars(RECORDS[0]) == {"train/peak_mem_mb/max": 110.0, "train/peak_mem_mb/rank_0": 100.0,
                                            "train/peak_mem_mb/rank_1": 110.0, "train/mem_mb/max": 95.0,
                                            "train/mem_mb/rank_0": 90.0, "train/mem_mb/rank_1": 95.0}
    # Hugging Face Trainer's names (transformers' rewrite_logs): eval_x -> eval/x, the rest train/x
    assert trackers.scalars(RECORDS[3]) == {"eval/loss": 4.4, "eval/tokens": 512, "eval/perplexity": 81.45}
    assert trackers.scalars({"step": 5, "loss": 2.0, "test_loss": 1.0}) == {"train/loss": 2.0, "test/loss": 1.0}
    many = trackers.scalars({"step": 1, "peak_mem_mb": list(range(trackers.PER_RANK_LIMIT + 1))})
    assert many == {"train/peak_mem_mb/max": trackers.PER_RANK_LIMIT}  # past the limit: the largest rank only


def test_none_opens_nothing(tmp_path):
    assert trackers.open_trackers(config_with(report_to="none"), tmp_path, 0) is None


def test_tensorboard_holds_the_records_and_resume_continues_from_the_checkpoint(tmp_path):
    config = config_with(report_to="tensorboard")
    reported = trackers.open_trackers(config, tmp_path, 0, {"backend": "cpu", "world_size": 2})
    for record in RECORDS + [{"step": 15, "loss": 4.0}]:
        reported.log(record)
    reported.close()
    events = tensorboard_events(tmp_path / "tensorboard")
    assert scalar_steps(events, "train/loss") == [(5, 5.5), (10, 4.5), (15, 4.0)]
    assert scalar_steps(events, "eval/loss") == [(10, 4.4)]
    assert scalar_steps(events, "train/peak_mem_mb/rank_1") == [(0, 110.0), (5, 130.0), (10, 131.0)]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "eval/perplexity",
            "train/peak_mem_mb/max"} <= set(events.Tags()["scalars"])
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| train.report_to | \"tensorboard\" |" in config_text and "| backend | \"cpu\" |" in config_text

    # Resumed from the checkpoint of step 10: what the first run logged after it (step 15) is dropped.
    resumed = trackers.open_trackers(config_with(report_to="tensorboard", resume=True), tmp_path, 10)
    resumed.log({"step": 15, "loss": 3.9})
    resumed.log({"step": 20, "loss": 3.5})
    resumed.close()
    assert scalar_steps(tensorboard_events(tmp_path / "tensorboard"), "train/loss") == [
        (5, 5.5), (10, 4.5), (15, 3.9), (20, 3.5)]


def test_wandb_offline_run_holds_the_records(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = config_with(report_to="wandb", wandb_project="unit")
    reported = trackers.open_trackers(config, tmp_path, 0, {"backend": "cpu", "world_size": 2})
    for record in RECORDS:
        reported.log(record)
    reported.close()
    run_id = (tmp_path / trackers.WANDB_RUN_ID).read_text().strip()
    [run_dir] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    rows = wandb_history(run_dir)
    assert [row["_step"] for row in rows] == [0, 5, 10]
    assert rows[0]["train/peak_mem_mb/rank_1"] == 110.0 and "train/loss" not in rows[0]
    assert (rows[1]["train/loss"], rows[1]["train/lr"], rows[1]["train/tokens_per_sec"], rows[1]["train/mfu"]) == (
        5.5, 1e-3, 1000.0, 0.01)
    assert (rows[2]["train/loss"], rows[2]["eval/loss"], rows[2]["eval/perplexity"],
            rows[2]["train/peak_mem_mb/max"]) == (
        4.5, 4.4, 81.45, 131.0)  # a step's training and eval records are one row
    config = wandb_config(run_dir)

    # The file read while wandb's service is mid-record: the records before the cut, none half-parsed.
    [log] = run_dir.glob("run-*.wandb")
    records = list(wandb_records(run_dir))
    log.write_bytes(log.read_bytes()[:-3])
    assert len(list(wandb_records(run_dir))) == len(records) - 1

    assert config["train.report_to"] == "wandb" and config["backend"] == "cpu"

    # A resumed run keeps the run id; a fresh run in the same directory gets a new one.
    trackers.open_trackers(config_with(report_to="wandb", resume=True), tmp_path, 10).close()
    assert (tmp_path / trackers.WANDB_RUN_ID).read_text().strip() == run_id
    trackers.open_trackers(config_with(report_to="wandb"), tmp_path, 0).close()
    assert (tmp_path / trackers.WANDB_RUN_ID).read_text().strip() != run_id
