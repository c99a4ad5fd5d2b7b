"""model.peft: peft's adapters injected into the transformers model in place, before it is parallelized.

The model stays the transformers model (no PeftModel around it), so the wrap classes, the lm_head of the chunked
loss and the model's config are found where they always are; each adapted Linear becomes peft's layer, holding
the frozen original as `base_layer` and the adapters as `lora_A.default` / `lora_B.default`. Only adapter
parameters require gradients, so only they reach the optimizer and FSDP2's reduce-scatters.

Adapters start from the same values on every rank and in every world size, however the base was built (whole, on
the meta device, or on rank 0 only): `initialize` draws each one's full value from the run's seed and gives each
rank its slice. Checkpoints hold the adapters in peft's own files (`adapter_model.safetensors`,
`adapter_config.json`: `PeftModel.from_pretrained(base, path)` loads them); `merged_weight` is merge_and_unload's
W + scale·B·A for a FULL export.
"""
from __future__ import annotations

import contextlib
import math
import pathlib

import torch

ADAPTER_NAME = "default"  # peft's name for a model's only adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What peft's own files put before a parameter's name in the model (PeftModel -> LoraModel -> the model).
PEFT_PREFIX = "base_model.model."
# What marks a LoRA parameter in a parameter's name.
ADAPTER_PARTS = (".lora_A.", ".lora_B.")
BASE_LAYER = ".base_layer"


def wanted(peft_cfg) -> bool:
    return bool(peft_cfg.type)


def lora_config(peft_cfg, base_source: str = ""):
    """peft's LoraConfig of model.peft; `base_source` is what adapter_config.json names as the base model."""
    from peft import LoraConfig

    return LoraConfig(r=peft_cfg.r, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
                      target_modules=list(peft_cfg.target_modules) or None, task_type="CAUSAL_LM",
                      base_model_name_or_path=base_source or None)


@contextlib.contextmanager
def tolerating_old_torchao():
    """peft 0.21 raises when it looks for torchao-quantized layers and finds torchao < 0.16 installed (the gpu
    extra pins 0.14.1, the release for torch 2.9); no layer here is torchao-quantized, so it is told there is none."""
    from peft import import_utils

    try:
        import_utils.is_torchao_available()
        yield
        return
    except ImportError:
        pass
    from unittest import mock

    from peft.tuners.lora import torchao as lora_torchao
    from peft.utils import quantization_utils

    with mock.patch.object(lora_torchao, "is_torchao_available", lambda: False), \
            mock.patch.object(quantization_utils, "is_torchao_available", lambda: False):
        yield


def add(model: torch.nn.Module, peft_cfg) -> None:
    """Inject the adapters into `model` in place (on the meta device when the model is there) and freeze the rest."""
    if not wanted(peft_cfg):
        return
    from peft import inject_adapter_in_model

    on_meta = any(p.is_meta for p in model.parameters())
    # peft draws the adapters' init from torch's generator: leave the run's stream as it was (`initialize` sets them)
    with tolerating_old_torchao(), torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(lora_config(peft_cfg), model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=on_meta)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def present(model: torch.nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def base_name(name: str) -> str:
    """A base parameter's (or buffer's) name in the model as transformers built it."""
    return name.replace(BASE_LAYER + ".", ".")


def peft_key(name: str) -> str:
    """An adapter parameter's name in peft's adapter_model.safetensors (the adapter's own name left out)."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


@torch.no_grad()
def initialize(model: torch.nn.Module, seed: int, fill) -> None:
    """Every adapter's starting value, as peft's default init (A: Kaiming-uniform, B: zeros, so the model starts
    as the base), drawn from `seed` in the model's parameter order; `fill(param, full)` gives this rank its part."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        fill(param, full)


def merge_partners(model: torch.nn.Module) -> dict:
    """{base weight's name: (lora_A's name, lora_B's name, scale)} of every adapted Linear (names as
    get_model_state_dict gives them: wrappers' parts removed)."""
    from peft.tuners.lora import LoraLayer

    from portable_fsdp.backends.hf_torch.export import clean_name

    partners = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            prefix = clean_name(module_name)
            partners[f"{prefix}{BASE_LAYER}.weight"] = (f"{prefix}.lora_A.{ADAPTER_NAME}.weight",
                                                       f"{prefix}.lora_B.{ADAPTER_NAME}.weight",
                                                       module.scaling[ADAPTER_NAME])
    return partners


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """merge_and_unload's weight of a Linear: W + scale·B·A."""
    return base + scale * (lora_b.to(base.dtype) @ lora_a.to(base.dtype))


def write_config(peft_cfg, directory: pathlib.Path, base_source: str) -> dict:
    """adapter_config.json as peft writes it. Returns {path: None}."""
    lora_config(peft_cfg, base_source).save_pretrained(str(directory))
    return {pathlib.Path(directory) / ADAPTER_CONFIG: None}


def write_weights(tensors: dict, directory: pathlib.Path) -> dict:
    """adapter_model.safetensors from {model name: full tensor}. Returns {path: None}."""
    from safetensors.torch import save_file

    path = pathlib.Path(directory) / ADAPTER_WEIGHTS
    save_file({peft_key(name): t.detach().cpu().contiguous() for name, t in tensors.items()}, str(path),
              metadata={"format": "pt"})
    return {path: None}


def read_weights(directory: pathlib.Path) -> dict:
    """{peft key: tensor} of a checkpoint's adapter_model.safetensors."""
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(directory) / ADAPTER_WEIGHTS))

