"""A stopped flax run resumes from its FULL checkpoint with the losses it would have had, and the
checkpoint format is the torch backends': a torch run resumes on flax."""
import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.flax.conftest import make_config, needs_devices
from tests.parity.reference import max_relative_difference


def run_in_process(workdir, overrides: dict, world_size: int = 2) -> list:
    """The loop as the CLI runs it, in this process; returns the per-step losses it logged."""
    from portable_fsdp import backends
    from portable_fsdp.training import loop
    from portable_fsdp.config.validate import resolve_plan

    config = make_config({"train.log_every": 1, **overrides})
    workdir.mkdir(exist_ok=True)
    loop.run(config, resolve_plan(config, world_size), backends.load("flax"), "flax", workdir)
    return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


@needs_devices(2)
@pytest.mark.parametrize("saved_under", [{}, pytest.param({"plan.tp_size": 2}, marks=pytest.mark.slow)])
def test_checkpoint_restores_weights_and_optimizer_state_exactly(tmp_path, saved_under):
    """Saved on 2 devices (fsdp 2, or tp 2), restored onto 1: a FULL checkpoint holds whole arrays."""
    import jax
    import numpy as np

    from portable_fsdp.backends.flax import checkpoint, optimizer, step
    from portable_fsdp.data.loader import TrainBatches, build_token_data
    from tests.flax.conftest import init_state

    config = make_config()
    state = init_state(make_config(saved_under), 2)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed)
    for index in range(2):
        state, _ = step.train_step(state, batches.micro_batches(index, 0, 1))
    checkpoint.save_checkpoint(state, tmp_path)
    restored = checkpoint.load_checkpoint(init_state(config, 1), tmp_path, {"step": 2})  # onto 1 device
    assert restored.step == 2
    for saved, loaded in ((state.params, restored.params), (optimizer.adam_moments(state.opt_state),
                                                            optimizer.adam_moments(restored.opt_state))):
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(loaded)))


@pytest.mark.slow
@needs_devices(2)
def test_resume_after_a_stop_gives_the_same_losses(tmp_path):
    straight = run_in_process(tmp_path / "straight", {})
    first = run_in_process(tmp_path / "split", {"train.stop_at_step": 10})
    both = run_in_process(tmp_path / "split", {"train.resume": True})
    assert len(first) == 10 and both[:10] == first
    assert both == straight  # weights and AdamW state restored exactly: bit-identical losses


@pytest.mark.slow
@needs_devices(2)
def test_a_torch_checkpoint_resumes_on_flax(tmp_path):
    """Stop a 2-process torch FSDP2 run at step 10, finish it on flax: the losses of steps 11-20 are those
    of the torch run that went straight through."""
    common = ["--config", TEST_RECIPE, "--config.train.log_every=1"]
    straight = cli(["--backend", "cpu", *common, "--workdir", str(tmp_path / "torch")], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = cli(["--backend", "cpu", *common, "--config.train.stop_at_step=10", "--workdir", str(tmp_path / "mixed")],
                  cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_in_process(tmp_path / "mixed", {"train.resume": True})
    torch_losses = [r["loss"] for r in read_metrics(tmp_path / "torch") if "loss" in r]
    assert max_relative_difference(resumed[10:], torch_losses[10:]) <= 1e-4


@pytest.mark.slow
@needs_devices(2)
def test_a_checkpoint_written_under_tensor_parallelism_resumes_on_fsdp(tmp_path):
    """Stopped at step 10 on tp 2, resumed on fsdp 2: steps 11-20 are those of a run that went straight through
    on fsdp 2 (a FULL checkpoint does not depend on the mesh that wrote it)."""
    straight = run_in_process(tmp_path / "straight", {})
    first = run_in_process(tmp_path / "split", {"plan.tp_size": 2, "train.stop_at_step": 10})
    both = run_in_process(tmp_path / "split", {"train.resume": True})
    assert len(first) == 10 and len(both) == 20
    assert max_relative_difference(both[10:], straight[10:]) <= 1e-5
