"""Start the xla lowering (SPMD FSDPv2 on PJRT CPU devices) from the meta device and write to JSON what the tests
check, per case:

- `bits`: the initial weights and buffers gathered to the CPU, against those of the build-whole path (the
  model made whole on the host, then moved and sharded: what start-up did before) — bit for bit, with the same
  sharding, tie and requires_grad per parameter; whether the whole model was built.
- `memory` (one process per path, as a peak never goes down): the host's resident set before start-up and just
  before the model is built, its peak once the model is on the devices (after parallelize) and at the end of
  start-up (which adds AdamW's moments on the devices).

    python tests/xla/meta_init_check.py OUT.json DEVICES bits CASE...
    python tests/xla/meta_init_check.py OUT.json DEVICES memory meta|whole
"""
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from portable_fsdp.backends.xla import environment  # noqa: E402  (imports no torch_xla)

DEVICES = int(sys.argv[2])
environment.configure(DEVICES)
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402

from portable_fsdp.machine import host_memory  # noqa: E402
from portable_fsdp.backends.xla import step as xla_step  # noqa: E402
from portable_fsdp.config.validate import resolve_plan  # noqa: E402
from tests.parity.matrix import make_config  # noqa: E402

TIED = {"model.tie_word_embeddings": "true"}
MOE = {"model.architecture": "mixtral", "model.config_overrides": {"num_local_experts": 4, "num_experts_per_tok": 2}}
CASES = {
    "llama": {},
    # tied embeddings, frozen norms, checkpointed layers
    "tied": {**TIED, "plan.activation_checkpointing": "true", "train.freeze": "norm"},
    "moe_ep2": {**MOE, "plan.ep_size": "2"},  # on 4 devices: fsdp 4 = 2 x ep 2
    "fsdp2_tp2": {"plan.tp_size": "2"},  # on 4 devices
    "hsdp2x2": {"plan.dp_replicate_size": "2"},  # on 4 devices: shards repeated over dp_replicate
}
# ~110M parameters (440 MB in fp32), tests/dist/meta_init_check.py's llama_100m: 32000 x 768 tied embeddings,
# 12 layers of 768 / 2048
LLAMA_100M = {"model.vocab_size": "32000", "model.hidden_size": "768", "model.intermediate_size": "2048",
              "model.num_hidden_layers": "12", "model.num_attention_heads": "12", "model.num_key_value_heads": "12",
              **TIED}

whole_builds = []
_create_model, _create_on_meta, _parallelize = xla_step.create_model, xla_step.create_on_meta, xla_step.parallelize


def counting_create_model(*args, **kwargs):
    whole_builds.append(1)
    return _create_model(*args, **kwargs)


xla_step.create_model = counting_create_model


before_build = {}  # the host's resident set and peak just before the model is built


def start(config, meta: bool):
    def create_on_meta(config):
        before_build.update(resident_mb=host_memory.resident_mb(), peak_mb=host_memory.peak_resident_mb())
        return _create_on_meta(config) if meta else None

    xla_step.create_on_meta = create_on_meta
    whole_builds.clear()
    return xla_step.init(config, resolve_plan(config, DEVICES), "xla")


def gathered(state) -> dict:
    """name -> (CPU value, sharding, requires_grad) of every parameter and buffer, tied copies under each name."""
    model = state.ctx.hf_model
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    return {name: (tensor.cpu(), torch_xla._XLAC._get_xla_sharding_spec(tensor),
                   params[name].requires_grad if name in params else None)
            for name, tensor in {**params, **dict(model.named_buffers())}.items()}


def tied(state) -> bool:
    model = state.ctx.hf_model
    return model.get_input_embeddings().weight is model.get_output_embeddings().weight


def bits(name: str) -> dict:
    config = make_config(CASES[name])
    meta = start(config, meta=True)
    built_whole = bool(whole_builds)
    got, got_tied = gathered(meta), tied(meta)
    del meta
    whole = start(config, meta=False)
    expected = gathered(whole)
    differing = sorted(n for n in expected if n in got and not torch.equal(got[n][0], expected[n][0]))
    return {"built_whole": built_whole, "compared": len(expected), "missing": sorted(set(expected) - set(got)),
            "extra": sorted(set(got) - set(expected)), "differing": differing,
            "sharding_differs": sorted(n for n in expected if n in got and got[n][1] != expected[n][1]),
            "requires_grad_differs": sorted(n for n in expected if n in got and got[n][2] != expected[n][2]),
            "frozen": sorted(n for n, v in got.items() if v[2] is False),
            "tied": got_tied, "reference_tied": tied(whole)}


def memory(path: str) -> dict:
    config = make_config(LLAMA_100M)
    after_parallelize = {}

    def parallelize(*args, **kwargs):
        root = _parallelize(*args, **kwargs)
        torch_xla.sync()
        after_parallelize.update(peak_mb=host_memory.peak_resident_mb(), resident_mb=host_memory.resident_mb())
        return root

    xla_step.parallelize = parallelize
    peak_before_mb = host_memory.peak_resident_mb()
    state = start(config, meta=path == "meta")
    params = sum(n.param.numel() for n in state.ctx.named)
    return {"path": path, "built_whole": bool(whole_builds), "params": params, "model_mb": params * 4 / 2**20,
            "baseline_mb": state.ctx.baseline_mb, "peak_before_mb": peak_before_mb, "before_build": before_build,
            "after_parallelize": after_parallelize,
            "peak_after_init_mb": host_memory.peak_resident_mb(), "resident_after_init_mb": host_memory.resident_mb()}


def main() -> None:
    out, mode, names = sys.argv[1], sys.argv[3], sys.argv[4:]
    results = {name: (memory if mode == "memory" else bits)(name) for name in names}
    pathlib.Path(out).write_text(json.dumps(results))
    xla_step.finalize()


if __name__ == "__main__":
    main()
