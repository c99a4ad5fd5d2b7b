"""Each array sits where the plan says: parameters and AdamW moments split along `fsdp` on their largest
divisible dimension (and along `tp` as the tensor-parallel plan says), norm scales replicated, checked against
golden dumps (as MaxText's sharding tests do) so a placement change shows up as a reviewed diff, never silently.

To rewrite the golden files after an intended change: python -m tests.flax.test_sharding --write-golden
"""
import json
import pathlib
import sys

import pytest

from tests.flax.conftest import init_state, make_config, needs_devices

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
GOLDEN = GOLDEN_DIR / "sharding_llama_tiny_test_fsdp2.json"
# golden file -> (plan overrides, devices): 2-D placements of fsdp 2 x tp 2
GOLDENS = {GOLDEN.name: ({}, 2), "sharding_llama_tiny_test_fsdp2_tp2.json": ({"plan.tp_size": 2}, 4)}


def placed_specs(state) -> dict:
    """{parameter: the PartitionSpec of the array actually placed on the devices}."""
    from portable_fsdp.backends.flax.sharding import spec_as_json

    return {name: spec_as_json(array.sharding.spec) for name, array in sorted(state.params.items())}


@pytest.fixture(scope="module")
def fsdp2_state():
    return init_state(make_config(), 2)


@needs_devices(4)
@pytest.mark.parametrize("golden_file", list(GOLDENS))
def test_parameter_shardings_match_the_golden_file(golden_file, fsdp2_state):
    golden = json.loads((GOLDEN_DIR / golden_file).read_text())
    overrides, world = GOLDENS[golden_file]
    placed = placed_specs(fsdp2_state if golden_file == GOLDEN.name else init_state(make_config(overrides), world))
    changed = {n: (golden.get(n), placed.get(n)) for n in golden.keys() | placed.keys()
               if golden.get(n) != placed.get(n)}
    assert not changed, (f"(golden, placed) differ: {changed}; if the change is intended, review it and run "
                         "python -m tests.flax.test_sharding --write-golden")


@needs_devices(2)
def test_each_device_holds_half_of_every_sharded_array(fsdp2_state):
    for name, array in fsdp2_state.params.items():
        shards = array.addressable_shards
        assert len(shards) == 2
        if "fsdp" in array.sharding.spec:
            assert all(s.data.size * 2 == array.size for s in shards), name
        else:
            assert array.ndim == 1, f"{name}: only norm scales are replicated"


@needs_devices(2)
def test_adam_moments_are_sharded_like_their_parameters(fsdp2_state):
    from portable_fsdp.backends.flax.optimizer import adam_moments

    _, mu, nu = adam_moments(fsdp2_state.opt_state)
    for moments in (mu, nu):
        for name, array in moments.items():
            assert array.sharding == fsdp2_state.params[name].sharding, name


def test_placement_rule():
    from jax.sharding import PartitionSpec as P

    from portable_fsdp.backends.flax.sharding import param_spec

    assert param_spec((384, 64), 2) == P("fsdp", None)  # the larger dimension
    assert param_spec((64, 160), 2) == P(None, "fsdp")
    assert param_spec((64, 64), 2) == P("fsdp", None)  # the first of equals
    assert param_spec((96, 64), 64) == P(None, "fsdp")  # the largest the axis divides
    assert param_spec((97, 33), 2) == P(None, None)  # none divisible: replicated
    assert param_spec((64,), 2) == P(None)  # small: replicated


def write_golden() -> None:
    for golden_file, (overrides, world) in GOLDENS.items():
        specs = placed_specs(init_state(make_config(overrides), world))
        lines = [f" {json.dumps(name)}: {json.dumps(spec)}" for name, spec in specs.items()]  # one parameter a line
        (GOLDEN_DIR / golden_file).write_text("{\n" + ",\n".join(lines) + "\n}\n")
        print(f"wrote {GOLDEN_DIR / golden_file}")


if __name__ == "__main__" and "--write-golden" in sys.argv:
    write_golden()
