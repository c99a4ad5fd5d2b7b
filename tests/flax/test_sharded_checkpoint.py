"""SHARDED_STATE_DICT on --backend flax (orbax): the state restored bit for bit onto another device count or mesh,
train.async_save writing in the background while training goes on, a stop and resume with the losses of a run
that went straight through, a kill mid-save leaving the previous checkpoint as `latest`, and the refusals across
backends and by the offline converter."""
import json

import pytest

from portable_fsdp.checkpoint import layout as checkpointing
from tests.conftest import TEST_RECIPE, cli
from tests.flax.conftest import make_config, needs_devices
from tests.flax.test_resume import run_in_process

SHARDED = {"plan.state_dict_type": "SHARDED_STATE_DICT", "train.steps": 4, "train.eval_every": 0}
ASYNC = {**SHARDED, "train.async_save": True, "train.save_every": 2}


class _Training:
    """The flax backend driven step by step over the loop's batches, on `world_size` devices."""

    def __init__(self, overrides: dict, world_size: int):
        from portable_fsdp.data.loader import TrainBatches, build_token_data
        from tests.flax.conftest import init_state

        config = make_config(overrides)
        self.state = init_state(config, world_size)
        data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
        self.batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed)

    def steps(self, count: int):
        from portable_fsdp.backends.flax import step

        for _ in range(count):
            self.state, _ = step.train_step(self.state, self.batches.micro_batches(self.state.step, 0, 1))
        return self.state


def _assert_restored(restored, params, opt_state, target) -> None:
    """Every array equal to the saved one, placed as `target`'s mesh places it."""
    import jax
    import numpy as np

    for name, array in restored.params.items():
        assert array.sharding == target.ctx.param_sharding[name] and np.array_equal(array, params[name]), name
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(opt_state)
    for after, before, placed in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(opt_state),
                                     jax.tree.leaves(target.ctx.opt_sharding)):
        assert after.sharding == placed and np.array_equal(after, before)


@needs_devices(2)
@pytest.mark.parametrize("resumed_under, world_size", [
    ({}, 1), pytest.param({"plan.tp_size": 2}, 2, marks=pytest.mark.slow)])
def test_a_sharded_checkpoint_reshards_onto_another_device_count_or_mesh(tmp_path, resumed_under, world_size):
    """Written on fsdp 2; read onto 1 device, or onto tp 2: every array equal, placed as the new mesh places it."""
    from portable_fsdp.backends.flax import checkpoint
    from tests.flax.conftest import init_state

    saved = _Training(SHARDED, 2).steps(2)
    written = checkpoint.save_checkpoint(saved, tmp_path)
    assert tmp_path / "sharded" / "manifest.ocdbt" in written and tmp_path / "config.json" in written
    assert all(p.is_file() for p in written) and not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
    target = init_state(make_config({**SHARDED, **resumed_under}), world_size)
    restored = checkpoint.load_checkpoint(target, tmp_path, {"step": 2})
    assert restored.step == 2
    _assert_restored(restored, saved.params, saved.opt_state, target)


@needs_devices(2)
def test_an_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path):
    """The call returns a future once the arrays are on the host; the next steps (which donate the arrays'
    buffers) run before it is done, and the files hold the state of the step saved."""
    import concurrent.futures

    import jax
    import numpy as np

    from portable_fsdp.backends.flax import checkpoint
    from tests.flax.conftest import init_state

    training = _Training(ASYNC, 2)
    saved = training.steps(2)
    params, opt_state = jax.tree.map(np.asarray, (saved.params, saved.opt_state))
    pending = checkpoint.save_checkpoint(saved, tmp_path)
    assert isinstance(pending, concurrent.futures.Future)
    moved_on = training.steps(2)
    written = pending.result(timeout=120)
    assert tmp_path / "sharded" / "manifest.ocdbt" in written and all(p.is_file() for p in written)
    assert not all(np.array_equal(moved_on.params[name], params[name]) for name in params)  # it did move on
    target = init_state(make_config(SHARDED), 1)
    _assert_restored(checkpoint.load_checkpoint(target, tmp_path, {"step": 2}), params, opt_state, target)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses of 4 steps on 2 devices without a stop."""
    return run_in_process(tmp_path_factory.mktemp("straight"), SHARDED)


@pytest.mark.slow  # three runs of the loop; the state's round trip is checked by default above
@needs_devices(2)
def test_a_stopped_sharded_run_resumes_bit_exact_from_orbax_files(tmp_path, straight):
    first = run_in_process(tmp_path, {**SHARDED, "train.stop_at_step": 2})
    latest = checkpointing.latest(tmp_path)
    manifest = checkpointing.verify(latest)
    assert checkpointing.stored_layout(latest) == "SHARDED_STATE_DICT" and manifest["backend"] == "flax"
    files = set(manifest["files"])
    assert {"config.json", "sharded/manifest.ocdbt", "sharded/_METADATA"} <= files
    assert any(name.startswith("sharded/ocdbt.process_0/") for name in files)
    assert not any(name.endswith(".safetensors") or name == checkpointing.OPTIMIZER for name in files)
    assert not any(".orbax-checkpoint-tmp" in name for name in files)  # orbax's rename stays inside the staging
    both = run_in_process(tmp_path, {**SHARDED, "train.resume": True})
    assert first == straight[:2] and both == straight  # weights and AdamW state restored bit for bit


@pytest.mark.slow  # three runs of the loop
@needs_devices(2)
def test_async_sharded_saves_commit_in_the_background_and_resume_bit_exact(tmp_path, straight):
    first = run_in_process(tmp_path, {**ASYNC, "train.stop_at_step": 3})  # saves at 2 (background) and 3 (the stop)
    saved = sorted(p.name for p in checkpointing.root(tmp_path).glob("step_*"))
    assert saved == ["step_00000002", "step_00000003"] and checkpointing.latest(tmp_path).name == "step_00000003"
    for name in saved:
        assert "sharded/manifest.ocdbt" in checkpointing.verify(checkpointing.root(tmp_path) / name)["files"]
    assert not list(checkpointing.root(tmp_path).glob(".tmp-step_*"))
    both = run_in_process(tmp_path, {**ASYNC, "train.resume": True})
    assert first == straight[:3] and both == straight


@pytest.mark.slow  # a CLI run
def test_a_kill_mid_async_save_leaves_the_previous_checkpoint_as_latest(tmp_path):
    """Killed once the step-4 save is written but before it is committed (in the background thread)."""
    proc = cli(["--backend", "flax", "--config", TEST_RECIPE, "--workdir", str(tmp_path),
                *(f"--config.{k}={v}" for k, v in {**ASYNC, "train.steps": 6}.items())],
               cwd=tmp_path, env={"PORTABLE_FSDP_FAULTS": "kill@save.written:step=4"})
    assert proc.returncode != 0
    latest = checkpointing.latest(tmp_path)
    assert latest.name == "step_00000002" and checkpointing.verify(latest)["step"] == 2
    assert not (checkpointing.root(tmp_path) / "step_00000004").exists()


@pytest.mark.slow  # a flax run, then the command's start-up check
@needs_devices(2)
def test_a_flax_sharded_checkpoint_is_refused_by_another_backend_before_it_starts(tmp_path):
    run_in_process(tmp_path, {**SHARDED, "train.stop_at_step": 2})
    proc = cli(["--backend", "cpu", "--config", TEST_RECIPE, "--workdir", str(tmp_path),
                "--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: train.resume: the checkpoint is a SHARDED_STATE_DICT of --backend flax, which --backend cpu cannot "
        "read; resume it with --backend flax, or save with plan.state_dict_type=FULL_STATE_DICT, which every backend "
        "loads"]


@pytest.mark.parametrize("written_by, resumed_by", [
    ("flax", "cpu"), ("flax", "cuda"), ("flax", "xla"), ("cpu", "flax"), ("cuda", "flax"), ("xla", "flax")])
def test_a_sharded_checkpoint_crosses_between_flax_and_torch_only_as_full(written_by, resumed_by):
    from portable_fsdp.errors import UserError

    config = make_config(SHARDED)
    manifest = {"backend": written_by, "state_dict_type": "SHARDED_STATE_DICT", "config": config.to_dict()}
    with pytest.raises(UserError) as refused:
        checkpointing.check_compatible(manifest, config, resumed_by)
    assert refused.value.line() == (
        f"error: train.resume: the checkpoint is a SHARDED_STATE_DICT of --backend {written_by}, which --backend "
        f"{resumed_by} cannot read; resume it with --backend {written_by}, or save with "
        "plan.state_dict_type=FULL_STATE_DICT, which every backend loads")
    checkpointing.check_compatible({**manifest, "state_dict_type": "FULL_STATE_DICT"}, config, resumed_by)
    checkpointing.check_compatible(manifest, config, written_by)


def test_convert_refuses_an_orbax_checkpoint_in_one_line(tmp_path, capsys):
    from portable_fsdp import convert

    source = tmp_path / "step_00000002"
    (source / checkpointing.SHARDED).mkdir(parents=True)
    (source / checkpointing.MANIFEST).write_text(json.dumps({"backend": "flax", "state_dict_type": "SHARDED_STATE_DICT",
                                                             "files": {}}))
    assert convert.main([str(source), str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: source: {source} is a SHARDED_STATE_DICT checkpoint of --backend flax (orbax files), which this "
        "converter does not read; run with --config.train.export_full_at_end=true for its FULL weights, or resume it "
        "on --backend flax with --config.plan.state_dict_type=FULL_STATE_DICT, whose saves are FULL"]
    assert not (tmp_path / "full").exists()


def test_convert_names_an_unreadable_manifest_in_one_line(tmp_path, capsys):
    from portable_fsdp import convert

    source = tmp_path / "step_00000002"
    (source / checkpointing.SHARDED).mkdir(parents=True)
    (source / checkpointing.MANIFEST).write_text("{not json")
    assert convert.main([str(source), str(tmp_path / "full")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "manifest.json is missing or unreadable" in line
    assert not (tmp_path / "full").exists()
