"""SHARDED_STATE_DICT (torch distributed checkpoint files) -> FULL_STATE_DICT offline, for `python -m
portable_fsdp.convert`: no process group, no GPU."""
from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.backends.hf_torch.model import full_state_dict_with_ties
from portable_fsdp.errors import UserError


def convert_sharded(source: pathlib.Path, target: pathlib.Path) -> None:
    """Write `target` as a FULL checkpoint (loads with from_pretrained, resumes at any world size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source, target = pathlib.Path(source), pathlib.Path(target)
    if not (source / checkpointing.SHARDED).is_dir():
        raise UserError("source", f"{source} holds no {checkpointing.SHARDED}/ directory; is it a SHARDED_STATE_DICT "
                        "checkpoint?")
    if target.exists():
        raise UserError("target", f"{target} exists; give a new directory (nothing is overwritten)")
    manifest = checkpointing.verify(source)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(source / checkpointing.SHARDED, pathlib.Path(scratch) / "full.pt")
            bundle = torch.load(pathlib.Path(scratch) / "full.pt", weights_only=False)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, local_files_only=True))
        model.load_state_dict(full_state_dict_with_ties(model, dict(bundle["model"])), strict=True)
        model.save_pretrained(staging, safe_serialization=True,
                              max_shard_size=manifest.get("config", {}).get("train", {}).get("max_shard_size", "5GB"))
        torch.save(bundle["optim"], staging / checkpointing.OPTIMIZER)
        for file in source.iterdir():  # the tokenizer and generation_config.json the training run saved
            if file.is_file() and file.name not in (checkpointing.MANIFEST, "config.json"):
                shutil.copy2(file, staging / file.name)
        rng = checkpointing.rng_file(source, 0).parent
        if rng.is_dir():
            shutil.copytree(rng, staging / rng.name)
        info = {k: v for k, v in manifest.items() if k != "files"}
        info["state_dict_type"] = "FULL_STATE_DICT"
        info["converted_from"] = str(source)
        checkpointing.write_manifest(staging, json.loads(json.dumps(info)))
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
