"""The flax backend places its initial weights one parameter at a time from the transformers model on the meta
device (portable_fsdp/backends/flax/initial.py): bit for bit the values of the whole build it replaces (create_model, its state
dict converted), with the plan's shardings, the same hf config and torch names for checkpoints, and no whole
torch model built; the process holds about one model at its largest; with several JAX processes, each copies
only the shards of its own devices."""
import concurrent.futures
import json

import numpy as np
import pytest

from benchmarks.common import ROOT, free_port, run_python
from portable_fsdp.backends.flax import architecture, torch_weights, initial, model as model_lib
from portable_fsdp.backends.hf_torch import model as hf_model_lib
from tests.flax.conftest import init_state, make_config, needs_devices
from tests.parity import families

TIED = {"model.tie_word_embeddings": "true"}
# case -> (overrides, devices); MIXTRAL_CONFIG and PRETRAINED are replaced by the `sources` fixture's paths
CASES = {
    "llama_fsdp2": ({}, 2),
    "tied_fsdp2": (TIED, 2),
    "fsdp2_tp2": ({"plan.tp_size": "2"}, 4),
    "mixtral_fsdp2_ep2": ({"model.config_from": "MIXTRAL_CONFIG", "plan.ep_size": "2"}, 4),
    "pretrained_bf16_tied": ({"model.init_from": "PRETRAINED"}, 2),  # the safetensors files read one by one
}
DEFAULT = ["llama_fsdp2"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """value -> itself, or for a placeholder the path it stands for, made on first use: a tiny Mixtral's
    config.json (random init), a tied Llama of the test recipe's sizes saved in bf16 (tests/dist/test_meta_init.py's,
    from another seed)."""
    made: dict = {}

    def make(name: str) -> str:
        from tests.dist.test_meta_init import pretrained

        directory = tmp_path_factory.mktemp(name.lower())
        if name == "PRETRAINED":
            return pretrained(directory)
        families.hf_config("mixtral").save_pretrained(directory)
        return str(directory / "config.json")

    def resolve(value: str) -> str:
        if value in ("MIXTRAL_CONFIG", "PRETRAINED") and value not in made:
            made[value] = make(value)
        return made.get(value, value)

    return resolve


def whole_build(config):
    """What the flax backend placed before: the whole torch model, its state dict converted."""
    hf_model = hf_model_lib.create_model(config, rank=0, rank0_only=False)
    arch = architecture.from_hf_config(hf_model.config)
    return hf_model, torch_weights.from_torch(hf_model.state_dict(), model_lib.define(arch).variables, arch)


@needs_devices(4)
@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_placed_one_parameter_at_a_time_bit_for_bit(case, sources, monkeypatch):
    overrides, world = CASES[case]
    config = make_config({key: sources(value) for key, value in overrides.items()})
    whole_builds = []
    create_model = hf_model_lib.create_model
    monkeypatch.setattr(hf_model_lib, "create_model", lambda *a, **k: whole_builds.append(1) or create_model(*a, **k))
    state = init_state(config, world)
    assert whole_builds == []  # the torch model was never built whole
    monkeypatch.undo()

    hf_model, expected = whole_build(config)
    assert state.params.keys() == expected.keys()
    for name, array in state.params.items():
        assert array.sharding == state.ctx.param_sharding[name], name
        value = np.asarray(array)
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape, name
        assert value.tobytes() == expected[name].tobytes(), name
    assert state.ctx.torch_names == tuple(hf_model.state_dict())
    assert state.ctx.hf_config.to_dict() == hf_model.config.to_dict()
    if case.startswith("mixtral"):
        assert any(".experts." in n and "ep" in str(a.sharding.spec) for n, a in state.params.items())


def test_an_init_that_cannot_be_replayed_is_built_whole(monkeypatch):
    """create_on_meta returns None (the init cannot be replayed bit for bit): the torch model is built whole and
    converted, as before."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    config = make_config()
    _, expected = whole_build(config)
    whole_builds = []
    create_model = hf_model_lib.create_model
    monkeypatch.setattr(hf_model_lib, "create_model", lambda *a, **k: whole_builds.append(1) or create_model(*a, **k))
    monkeypatch.setattr(hf_model_lib, "create_on_meta", lambda config: None)
    weights = initial.prepare(config, remat=False)
    one_device = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("fsdp",)), PartitionSpec())
    placed = weights.place({name: one_device for name in weights.model_def.variables})
    assert whole_builds == [1]
    assert placed.keys() == expected.keys()
    assert all(np.asarray(placed[n]).tobytes() == expected[n].tobytes() for n in expected)


def run_check(module: str, *args: str, timeout: float = 600) -> dict:
    proc = run_python(["-m", module, *args], timeout, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_host_memory_is_about_one_model():
    """~110M parameters (418 MiB in fp32) on 2 host devices split over fsdp: what placing the initial weights adds
    to the process's resident set at its largest is about the placed model plus its largest parameter (measured
    1.34x the model), where building the torch model whole, converting it and device_put-ing it took 2.56x."""
    meta = run_check("tests.flax.init_memory_check", "meta")
    whole = run_check("tests.flax.init_memory_check", "whole")
    assert meta["params"] > 100e6
    on_meta, built_whole = (r["peak_mb"] - r["before_mb"] for r in (meta, whole))
    assert on_meta <= 1.5 * meta["model_mb"], (meta, whole)
    assert built_whole >= 2.2 * whole["model_mb"], (meta, whole)  # the measurement sees the copies it should


@pytest.mark.slow
def test_each_process_copies_only_its_own_shards(tmp_path):
    """2 JAX processes of 2 host devices, fsdp 2 x tp 2: every shard a process holds is the whole build's, and it
    read from the host only shards of its own devices (at most one per device; replicated ones once)."""
    port = str(free_port())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = [pool.submit(run_python, ["-m", "tests.flax.multiprocess_init_check", str(tmp_path / f"{i}.json"),
                                          str(i), port], 600, {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
                 for i in range(2)]
        for proc in procs:
            assert proc.result().returncode == 0, proc.result().stderr[-4000:]
    for i in range(2):
        result = json.loads((tmp_path / f"{i}.json").read_text())
        assert (result["process"], result["processes"]) == (i, 2)
        assert result["differing"] == [] and result["tp_split"] > 0
        assert result["addressable_shards"] * 2 == result["global_shards"]
        assert 0 < result["copied_shards"] <= result["addressable_shards"], result
