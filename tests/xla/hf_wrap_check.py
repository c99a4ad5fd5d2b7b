"""Wrap the test model from one Hugging Face fsdp_config twice — as the command does (the file read, the xla
backend's start-up) and as Trainer does (TrainingArguments, then transformers' wrap_model_xla_fsdp) — and write
to JSON what each chose: FSDP v1 or v2, the modules that became FSDP units, the modules checkpointed, and (v1)
the keyword arguments given to XlaFullyShardedDataParallel.

    python tests/xla/hf_wrap_check.py OUT.json FSDP.json DEVICES
"""
import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from portable_fsdp.backends.xla import environment  # noqa: E402  (imports no torch_xla)

DEVICES = int(sys.argv[3])
environment.configure(DEVICES)
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402

from portable_fsdp.backends import xla as xla_backend  # noqa: E402
from portable_fsdp.backends.hf_torch.model import create_model  # noqa: E402
from portable_fsdp.backends.xla import fsdp_settings, step as xla_step  # noqa: E402
from portable_fsdp.config.hf_import import apply_fsdp_file  # noqa: E402
from portable_fsdp.config.validate import resolve_plan  # noqa: E402
from tests.parity.matrix import make_config  # noqa: E402

WRAPPERS = (XlaFullyShardedDataParallel, SpmdFullyShardedDataParallel)
WRAPPER_ATTRIBUTES = ("_fsdp_wrapped_module", "_fpw_module", "_orig_module", "module")  # the wrappers' own


def describe(root) -> dict:
    """Units and checkpointed modules by their names in the model, wrapper levels left out."""
    def plain(name):
        return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)

    modules = list(root.named_modules())
    return {"v2": isinstance(root, SpmdFullyShardedDataParallel),
            "units": sorted(plain(n) for n, m in modules if isinstance(m, WRAPPERS)),
            "checkpointed": sorted(plain(n) for n, m in modules if "_xla_checkpointed_forward_original" in vars(m))}


def shown(kwargs: dict) -> dict:
    return {key: str(value) if isinstance(value, torch.dtype) else value for key, value in kwargs.items()}


def ours(path: str) -> dict:
    config = make_config({})
    apply_fsdp_file(config, path)
    xla_backend.prepare_config(config)
    plan = resolve_plan(config, DEVICES)
    state = xla_step.init(config, plan, "xla")
    found = describe(state.model)
    if not plan.xla.xla_fsdp_v2:
        found["kwargs"] = shown(fsdp_settings.v1_kwargs(plan, plan.xla.xla_fsdp_settings,
                                                        fsdp_settings.v1_signature(), config.train.weight_decay))
    return found


def hugging_face(path: str) -> dict:
    from transformers import TrainingArguments
    from transformers.integrations.tpu import wrap_model_xla_fsdp

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, fsdp=True, fsdp_config=path, report_to=[])
    v2 = bool(args.fsdp_config["xla_fsdp_v2"])  # Trainer: is_fsdp_xla_v2_enabled (its mesh: ours, already set)
    model = create_model(make_config({}), rank=0, rank0_only=False)
    found = describe(wrap_model_xla_fsdp(model, args, v2))
    if not v2:
        found["kwargs"] = shown(args.xla_fsdp_config)
    return found


if __name__ == "__main__":
    fsdp_json = sys.argv[2]
    result = {"ours": ours(fsdp_json), "hugging_face": hugging_face(fsdp_json)}
    pathlib.Path(sys.argv[1]).write_text(json.dumps(result))
