"""train.epochs: a run of whole passes over the train split, counted once before the workers start, the same count
when a run resumes."""
import pytest

from portable_fsdp.config.schema import load_recipe
from portable_fsdp.config.validate import check_train_fields
from portable_fsdp.data.loader import resolve_epochs, steps_for_epochs
from portable_fsdp.errors import Notice, UserError
from tests.conftest import TEST_RECIPE, cli, read_metrics


def test_steps_cover_the_epochs_with_the_last_batch_reaching_into_the_next():
    assert steps_for_epochs(1, 24, 4) == 6
    assert steps_for_epochs(1, 25, 4) == 7
    assert steps_for_epochs(0.5, 24, 4) == 3


def test_epochs_become_steps_once():
    config = load_recipe(TEST_RECIPE)
    config.train.update({"steps": 0, "epochs": 2.0})
    with pytest.warns(Notice, match="train.epochs=2 is train.steps=12: 24 train sequences, 4 a step"):
        resolve_epochs(config.train, 24)
    resolve_epochs(config.train, 30)  # the workers (or a second Batches) read it again: already steps
    assert (config.train.steps, config.train.epochs) == (12, 0.0)
    check_train_fields(config, 1)


@pytest.mark.parametrize("settings, words", [
    ({"epochs": 1.0}, "train.epochs: and train.steps=20 are both set; set train.steps=0"),
    ({"steps": 0}, "train.steps: must be positive"),
    ({"steps": 0, "epochs": -1.0}, "train.epochs: must be >= 0"),
])
def test_a_run_has_one_length(settings, words):
    config = load_recipe(TEST_RECIPE)
    config.train.update(settings)
    with pytest.raises(UserError) as caught:
        check_train_fields(config, 1)
    assert caught.value.line().startswith(f"error: {words}")


def test_epochs_with_streaming_is_one_line():
    config = load_recipe(TEST_RECIPE)
    config.train.update({"steps": 0, "epochs": 1.0})
    config.data.streaming = True
    with pytest.raises(UserError, match="data.streaming learns only as it trains"):
        check_train_fields(config, 1)


def run_by_epochs(tmp_path, *more):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"line {i} of a small corpus." for i in range(80)))
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "run"), "--backend", "cpu", "--nproc", "1",
                f"--config.data.source={corpus}", "--config.train.steps=0", "--config.train.epochs=1",
                "--config.train.log_every=1", *more], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if "train.epochs=1 is train.steps=" in line]


def assert_one_epoch(workdir, counted):
    epochs = [r["epoch"] for r in read_metrics(workdir) if "loss" in r]
    assert len(epochs) > 2 and epochs[-2] < 1 <= epochs[-1]  # the last step is the first to finish the split
    assert len(counted) == 1 and f"is train.steps={len(epochs)}:" in counted[0]


def test_one_epoch_ends_where_the_train_split_is_used_up(tmp_path):
    assert_one_epoch(tmp_path / "run", run_by_epochs(tmp_path))


@pytest.mark.slow  # two runs
def test_a_resumed_run_counts_the_same_steps(tmp_path):
    counted = run_by_epochs(tmp_path, "--config.train.stop_at_step=2")
    assert run_by_epochs(tmp_path, "--config.train.resume=true") == counted
    assert_one_epoch(tmp_path / "run", counted)
