"""What the torch-based backends (cpu/cuda, xla) share to write a FULL checkpoint as `save_pretrained` would:
tensors as the raw bytes portable_fsdp.checkpoint.safetensors_shards writes, and config.json + generation_config.json
(`model_config`: their checkpoint_files.Writer's)."""
from __future__ import annotations

import copy
import pathlib

import torch

from portable_fsdp.checkpoint import safetensors_shards
from portable_fsdp.errors import UserError

# Wrappers' parts of parameter names that state dicts leave out (activation checkpointing, torch.compile, FSDP1).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_copies(model) -> set:
    """Names of parameters that are another, earlier parameter (tied embeddings): checkpoints leave them out."""
    seen, copies = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            copies.add(clean_name(name))
        seen.add(id(param))
    return copies


def require_shape(directory, name: str, stored: list, shape) -> None:
    """A resume fills a parameter only from a tensor of its shape: another model's weight is one line."""
    if tuple(stored) != tuple(shape):
        raise UserError("train.resume", (f"the weights in {directory} hold {name} of shape {tuple(stored)}, the model's "
                                         f"is {tuple(shape)}: another model"))


def stored_dtype(tensor: torch.Tensor, save_dtype: str) -> torch.dtype:
    """Floating-point tensors are written in train.save_dtype, others (integer buffers) as they are."""
    return getattr(torch, save_dtype) if tensor.is_floating_point() else tensor.dtype


def entry(name: str, tensor: torch.Tensor, shape, save_dtype: str) -> safetensors_shards.Tensor:
    return safetensors_shards.Tensor(name, str(stored_dtype(tensor, save_dtype)).removeprefix("torch."), tuple(shape))


def host_bytes(tensor: torch.Tensor, save_dtype: str):
    """The tensor on the CPU in its stored dtype, as a flat uint8 array (what a safetensors file holds)."""
    host = tensor.detach().to("cpu", stored_dtype(tensor, save_dtype)).contiguous()
    return host.reshape(-1).view(torch.uint8).numpy()


def write_model_config(model, model_class: str, directory: pathlib.Path, save_dtype: str) -> dict:
    """config.json (the class to build, the dtype of the weights) and generation_config.json, as save_pretrained
    writes them beside the weights. Returns {path: None}."""
    directory = pathlib.Path(directory)
    config = copy.deepcopy(model.config)
    config.architectures = [model_class]
    config.dtype = save_dtype
    config.save_pretrained(directory)
    written = {directory / "config.json": None}
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
        written[directory / "generation_config.json"] = None
    return written


def model_config(model, model_class: str, directory: pathlib.Path, save_dtype: str, full: bool) -> dict:
    """A checkpoint's model config (portable_fsdp.checkpoint.files.Writer.model_config): beside FULL weights,
    `write_model_config`'s files; beside SHARDED files, the model's config.json as it is. Returns {path: None}.
    A user's module has no transformers config: its weights alone (a resume matches them by name and shape)."""
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        return {}
    if full:
        return write_model_config(model, model_class, directory, save_dtype)
    model.config.save_pretrained(directory)
    return {pathlib.Path(directory) / "config.json": None}
