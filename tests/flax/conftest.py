"""JAX host devices for the flax tests, and helpers that train in-process.

XLA reads the host-device count once, when jax is first imported, so it is set here, before any test
module imports jax: one pytest process then holds HOST_DEVICES CPU devices, and a run on fewer uses
the first ones.
"""
import contextlib

import pytest

from portable_fsdp.backends.flax.devices import configure_host_devices

HOST_DEVICES = 4  # the matrix's largest world (tests/parity/matrix.py)
configure_host_devices(HOST_DEVICES)


def make_config(overrides: dict | None = None):
    """portable_fsdp/configs/llama_tiny.py:test with `--config.KEY=VALUE` overrides."""
    from tests.parity import matrix

    return matrix.make_config(overrides or {})


def init_state(config, world_size: int, parts=None):
    """`parts`: a portable_fsdp.training.parts.Parts of the user's own (None: the config's)."""
    from portable_fsdp.backends.flax import step
    from portable_fsdp.config.validate import resolve_plan
    from portable_fsdp.training.parts import NONE

    return step.init(config, resolve_plan(config, world_size), "flax", parts or NONE)


def train_batches(config):
    """The loop's own training batches of `config` (`.micro_batches(step, 0, 1)`: one process reads them all)."""
    from portable_fsdp.data.loader import TrainBatches, build_token_data

    t = config.train
    data = build_token_data(config.data, config.model.vocab_size, t.batch_size)
    documents_end_at = data.eos_token_id if config.data.document_masking else None
    return TrainBatches(data.train, t.batch_size, t.grad_accum_steps, config.seed, documents_end_at)


def flax_metrics(config, world_size: int, steps: int, parts=None) -> list:
    """Per-step metrics of the flax backend on `world_size` devices, over the loop's own batches."""
    from portable_fsdp.backends.flax import step

    state, batches = init_state(config, world_size, parts), train_batches(config)
    metrics = []
    for index in range(steps):
        state, step_metrics = step.train_step(state, batches.micro_batches(index, 0, 1))
        metrics.append(step_metrics)
    return metrics


def flax_losses(config, world_size: int, steps: int, parts=None) -> list:
    """Per-step losses of the flax backend on `world_size` devices, over the loop's own batches."""
    return [m["loss"] for m in flax_metrics(config, world_size, steps, parts)]


@contextlib.contextmanager
def torch_threads(n: int):
    """The torch reference on one thread: on these shared 2-core machines, torch's default threads
    contend with everything else and a 20-step reference takes 20 s instead of 4."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def needs_devices(n: int):
    import jax

    return pytest.mark.skipif(len(jax.devices()) < n, reason=f"jax was initialised with fewer than {n} devices")
