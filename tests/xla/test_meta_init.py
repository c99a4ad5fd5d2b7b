"""SPMD FSDPv2 starts from the meta device (hf_torch.model.create_on_meta, portable_fsdp/backends/xla/materialize.py): each
parameter's full value is made on the host and sent to the devices already sharded, one parameter at a time.
The initial weights and buffers gathered to the CPU are the build-whole path's bit for bit, with the same
shardings, ties and frozen parameters — a tiny Llama on 2 devices by default; slow, on 4: tied embeddings with
checkpointed layers and frozen norms, a tiny Mixtral with fsdp 4 = 2 x ep 2, fsdp 2 x tp 2, HSDP 2 x 2 — and
the host's peak memory while a ~110M-parameter Llama is built and sharded stays near one copy of the model
(slow)."""
import json

import pytest

from tests.xla.helpers import run_script

CASES = [(2, ["llama"]), pytest.param(4, ["tied", "moe_ep2", "fsdp2_tp2", "hsdp2x2"], marks=pytest.mark.slow)]


def run_check(tmp_path, devices: int, mode: str, names: list) -> dict:
    out = tmp_path / f"{mode}-{devices}-{'-'.join(names)}.json"
    run_script("meta_init_check.py", [out, devices, mode, *names])
    return json.loads(out.read_text())


@pytest.mark.parametrize("devices,names", CASES, ids=lambda v: "-".join(v) if isinstance(v, list) else f"{v}dev")
def test_meta_init_is_the_build_whole_init(tmp_path, devices, names):
    results = run_check(tmp_path, devices, "bits", names)
    for name in names:
        result = results[name]
        assert not result["built_whole"], name
        assert result["compared"] > 0 and result["missing"] == result["extra"] == [], (name, result)
        assert result["differing"] == [], (name, result["differing"])
        assert result["sharding_differs"] == result["requires_grad_differs"] == [], (name, result)
        assert result["tied"] == result["reference_tied"] == (name == "tied"), name
        frozen = result["frozen"]
        assert (bool(frozen) and all("norm" in n for n in frozen)) if name == "tied" else not frozen, (name, frozen)


@pytest.mark.slow
def test_the_host_never_holds_the_whole_model(tmp_path):
    """~110M parameters (418 MiB in fp32) on 2 PJRT CPU devices, whose shards are host memory too: what the
    host's peak resident set grows by from just before the model is built until it is sharded on the devices.
    Measured: 1.25x the model's bytes from the meta device (the shards, plus the last full values in flight),
    1.86x when built whole (the host model and the shards together)."""
    meta = run_check(tmp_path, 2, "memory", ["meta"])["meta"]
    whole = run_check(tmp_path, 2, "memory", ["whole"])["whole"]
    assert meta["params"] > 100e6 and not meta["built_whole"] and whole["built_whole"]

    def growth(result: dict, key: str) -> float:
        return (result["after_parallelize"][key] - result["before_build"]["resident_mb"]) / result["model_mb"]

    assert growth(whole, "peak_mb") > 1.6, whole  # the measure sees a whole host copy beside the shards
    assert growth(meta, "peak_mb") < 1.4, meta
    assert growth(meta, "resident_mb") < 1.15, meta  # the shards, and nothing of the host values left
