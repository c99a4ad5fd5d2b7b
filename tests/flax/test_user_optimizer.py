"""An optax transformation and a schedule of the user's own on --backend flax: the schedule sets the learning rate
of every step (metrics["lr"] is its value), train.max_grad_norm and train.nonfinite act as with the built-in
optimizer, and a checkpoint of a user's model and optimizer resumes bit for bit."""
import numpy as np
import pytest

from tests.flax.conftest import init_state, make_config, needs_devices, train_batches
from tests.flax.test_user_model import mlp


def sgd_with_momentum():
    import optax

    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.0, momentum=0.9)


def halving(step: int) -> float:
    return 0.1 / 2 ** step


def parts_for(config, **given):
    from portable_fsdp.training.parts import Parts

    return Parts(**{"model": mlp(config.model.vocab_size), "optimizer": sgd_with_momentum(), "schedule": halving,
                    **given})


def train(state, batches, steps: int) -> tuple:
    from portable_fsdp.backends.flax import step

    metrics = []
    for _ in range(steps):
        state, step_metrics = step.train_step(state, batches.micro_batches(state.step, 0, 1))
        metrics.append(step_metrics)
    return state, metrics


def test_the_schedule_sets_each_steps_learning_rate():
    import optax

    config = make_config()
    _, metrics = train(init_state(config, 1, parts_for(config)), train_batches(config), 3)
    assert [m["lr"] for m in metrics] == [halving(s) for s in range(3)]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    schedule = optax.linear_schedule(0.1, 0.0, 10)  # an optax schedule: its value as a Python float
    _, metrics = train(init_state(config, 1, parts_for(config, schedule=schedule)), train_batches(config), 2)
    assert [m["lr"] for m in metrics] == [float(schedule(s)) for s in range(2)]


def test_max_grad_norm_clips_and_nonfinite_skips_as_with_the_built_in_optimizer():
    import jax.numpy as jnp
    import optax

    config = make_config({"train.max_grad_norm": 1e-3, "train.nonfinite": "skip"})
    plain_sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    state = init_state(config, 1, parts_for(config, optimizer=plain_sgd, schedule=lambda _: 1.0))
    before = {name: np.asarray(value) for name, value in state.params.items()}
    state, (metrics,) = train(state, train_batches(config), 1)
    moved = np.sqrt(sum(np.sum((np.asarray(state.params[n]) - before[n]) ** 2) for n in before))
    assert metrics["grad_norm"] > 1e-2 and moved == pytest.approx(1e-3, rel=1e-3)  # lr 1 x the clipped gradient

    def poisoned(outputs, batch):
        return jnp.sum(outputs) * jnp.nan, jnp.float32(1.0)

    state = init_state(config, 1, parts_for(config, loss=poisoned))
    before = {name: np.asarray(value) for name, value in state.params.items()}
    state, (metrics,) = train(state, train_batches(config), 1)
    assert metrics["skipped"] and all(np.array_equal(state.params[n], before[n]) for n in before)


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT",
                                             pytest.param("SHARDED_STATE_DICT", marks=pytest.mark.slow)])
@needs_devices(2)
def test_a_checkpoint_resumes_the_model_and_optimizer_bit_for_bit(tmp_path, state_dict_type):
    """Saved after 2 steps on fsdp 2, restored into a fresh state: the next 2 steps as without the stop."""
    import jax
    from safetensors import safe_open

    from portable_fsdp.backends.flax import checkpoint

    config = make_config({"plan.fsdp_size": 2, "plan.state_dict_type": state_dict_type})
    batches = train_batches(config)
    state, _ = train(init_state(config, 2, parts_for(config)), batches, 2)
    checkpoint.save_checkpoint(state, tmp_path)
    if state_dict_type == "FULL_STATE_DICT":  # the weights by the module's dotted paths
        with safe_open(tmp_path / "model.safetensors", "numpy") as saved:
            assert set(saved.keys()) == set(state.params) and "layers.0.up.kernel" in saved.keys()
    restored = checkpoint.load_checkpoint(init_state(config, 2, parts_for(config)), tmp_path, {"step": 2})
    state, straight = train(state, batches, 2)
    restored, resumed = train(restored, batches, 2)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]
    for after, before in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                             jax.tree.leaves((state.params, state.opt_state))):
        assert np.array_equal(after, before)


def test_a_checkpoint_of_another_optimizer_is_refused_on_resume(tmp_path):
    import optax

    from portable_fsdp.backends.flax import checkpoint
    from portable_fsdp.errors import UserError
    from portable_fsdp.training.parts import Parts

    config = make_config()
    state, _ = train(init_state(config, 1, parts_for(config)), train_batches(config), 1)
    checkpoint.save_checkpoint(state, tmp_path)
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.0)
    with pytest.raises(UserError, match="state of another optimizer") as err:
        checkpoint.load_checkpoint(init_state(config, 1, parts_for(config, optimizer=adam)), tmp_path, {"step": 1})
    assert err.value.field == "train.resume"
    state, _ = train(init_state(config, 1, Parts(optimizer=sgd_with_momentum())), train_batches(config), 1)
    (tmp_path / "llama").mkdir()
    checkpoint.save_checkpoint(state, tmp_path / "llama")  # the built-in model, a user's optimizer
    with pytest.raises(UserError, match="state of another optimizer"):  # into the built-in AdamW
        checkpoint.load_checkpoint(init_state(config, 1), tmp_path / "llama", {"step": 1})


def test_the_learning_rate_must_be_settable():
    import optax

    from portable_fsdp.backends.flax import optimizer
    from portable_fsdp.errors import UserError

    config = make_config()
    with pytest.raises(UserError, match=r"wrap it with optax.inject_hyperparams") as err:
        init_state(config, 1, parts_for(config, optimizer=optax.sgd(0.1)))
    assert err.value.field == "optimizer" and "\n" not in str(err.value)
    with pytest.raises(UserError, match="not an optax GradientTransformation"):
        init_state(config, 1, parts_for(config, optimizer=lambda params: None))  # a torch-style factory
    params = {"w": np.zeros((2, 2), np.float32)}
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    for nested in (optax.chain(optax.clip(1.0), inner), optax.MultiSteps(inner, every_k_schedule=2)):
        optimizer.check_learning_rate(nested.init(params))  # found inside chain and MultiSteps


@needs_devices(2)
def test_the_loop_stops_and_resumes_a_run_of_ones_own_parts_with_the_same_losses(tmp_path, capsys):
    """As the command runs it: a user's model, loss, optimizer and schedule, evaluated (eval_tokens: the loss's
    count) and checkpointed by the loop, stopped at step 2 and resumed: the losses of a run that went straight
    through."""
    from portable_fsdp import backends
    from portable_fsdp.config.validate import resolve_plan
    from portable_fsdp.training import loop
    from portable_fsdp.data.loader import open_data
    from tests.conftest import read_metrics
    from tests.flax.test_user_loss import weighted, weights

    def config_with(overrides):
        return make_config({"plan.fsdp_size": 2, "train.steps": 4, "train.log_every": 1, "train.eval_every": 2,
                            "train.save_every": 2, **overrides})

    def run(workdir, overrides):
        config = config_with(overrides)
        workdir.mkdir(exist_ok=True)
        loop.run(config, resolve_plan(config, 2), backends.load("flax"), "flax", workdir,
                 parts=parts_for(config, loss=weighted))
        return read_metrics(workdir)

    straight = run(tmp_path / "straight", {})
    assert "4 (lr from the schedule passed in)" in capsys.readouterr().out  # not the config's train.lr
    run(tmp_path / "split", {"train.stop_at_step": 2})
    resumed = run(tmp_path / "split", {"train.resume": True})
    losses = [[(r["step"], r["loss"], r["lr"]) for r in records if "loss" in r] for records in (straight, resumed)]
    assert losses[0] == losses[1] and [lr for _, _, lr in losses[0]] == [halving(s) for s in range(4)]
    config = config_with({})
    _, eval_batches = open_data(config, config.model.vocab_size, 0, 1)
    weight_sum = sum(float(np.asarray(weights(batch.labels)).sum()) for batch in eval_batches)
    assert [r["eval_tokens"] for r in straight if "eval_loss" in r] == [weight_sum, weight_sum]
