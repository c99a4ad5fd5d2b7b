"""What the plan's fields become in JAX (what the flax lowering refuses or ignores: tests/unit/test_capabilities.py)."""
import re

import numpy as np

from tests.flax.conftest import init_state, make_config, needs_devices


@needs_devices(2)
def test_activation_checkpointing_rematerializes_each_layer():
    import jax

    def rematerialized_regions(overrides):
        state = init_state(make_config(overrides), 2)
        rows = np.zeros((1, 4, 64), np.int32)
        jaxpr = jax.make_jaxpr(state.ctx.programs.train)(state.params, state.opt_state, rows, rows, rows, 1.0, 1e-3)
        return len(re.findall(r"\bremat\w*\[|\bcheckpoint\[", str(jaxpr)))  # jax.checkpoint's primitive

    # one per decoder layer, on top of what the step rematerializes anyway (the chunked loss's projection)
    assert rematerialized_regions({"plan.activation_checkpointing": True}) - rematerialized_regions({}) == 2


@needs_devices(2)
def test_mixed_precision_keeps_float32_masters():
    state = init_state(make_config({"plan.param_dtype": "bfloat16"}), 2)
    assert {a.dtype.name for a in state.params.values()} == {"float32"}  # bf16 is the compute dtype only


@needs_devices(2)
def test_a_nonfinite_step_leaves_weights_and_optimizer_untouched():
    import jax

    state = init_state(make_config(), 2)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    rows = jax.device_put(np.ones((1, 4, 64), np.int32))
    params, opt_state, out = state.ctx.programs.train(state.params, state.opt_state, rows, rows, rows,
                                                      np.float32("nan"), np.float32(1e-3))  # NaN loss and gradients
    assert not bool(out["finite"])
    after = jax.tree.map(np.asarray, (params, opt_state))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
