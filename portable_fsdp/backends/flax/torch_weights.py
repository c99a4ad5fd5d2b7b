"""Lossless weight conversion between a transformers Llama state dict and the Flax parameter dict.

Names map one to one (see model.py); linear kernels are transposed (torch [out, in], flax [in, out]);
the embedding is `embedding` in flax and `weight` in torch. Mixtral's fused expert weights keep their names and
are [in, out] per expert in flax as well: `experts.down_proj` torch [E, hidden, I] -> [E, I, hidden], and
`experts.gate_up_proj` torch [E, 2I, hidden] -> [E, 2, hidden, I] (the gate half, then the up half). A transpose and a rename lose no bit, in
any dtype. With tied embeddings the Flax model has no lm_head: the torch side gets `lm_head.weight`
back as the embedding, as `LlamaForCausalLM.state_dict()` shows it.

Arrays on the Flax side of these functions are numpy (host) arrays; placing them on devices is
sharding.py's job. A whole state dict converts at once (from_torch), or one parameter at a time as the model's
init delivers it (by_torch_name, to_flax: initial.py).
"""
from __future__ import annotations

import pathlib

import numpy as np

from portable_fsdp.backends.flax.architecture import LlamaArchitecture
from portable_fsdp.checkpoint import safetensors_shards
from portable_fsdp.errors import UserError

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def torch_name(flax_name: str) -> str:
    prefix, _, leaf = flax_name.rpartition(".")
    if leaf in ("kernel", "embedding"):
        return f"{prefix}.weight"
    return flax_name  # norm `weight`, linear `bias`


def is_kernel(flax_name: str) -> bool:
    return flax_name.endswith(".kernel")


GATE_UP, DOWN = ".experts.gate_up_proj", ".experts.down_proj"


def to_flax_layout(flax_name: str, array: np.ndarray) -> np.ndarray:
    """A torch tensor's values in the flax parameter's layout (a transpose or reshape: no value changes)."""
    if is_kernel(flax_name) or flax_name.endswith(DOWN):
        return np.ascontiguousarray(np.swapaxes(array, -1, -2))
    if flax_name.endswith(GATE_UP):
        experts, fused, hidden = array.shape
        return np.ascontiguousarray(np.swapaxes(array.reshape(experts, 2, fused // 2, hidden), -1, -2))
    return array


def to_torch_layout(flax_name: str, array: np.ndarray) -> np.ndarray:
    """The inverse of to_flax_layout."""
    if is_kernel(flax_name) or flax_name.endswith(DOWN):
        return np.swapaxes(array, -1, -2)
    if flax_name.endswith(GATE_UP):
        experts, _, hidden, inner = array.shape
        return np.swapaxes(array, -1, -2).reshape(experts, 2 * inner, hidden)
    return array


def tensor_to_numpy(tensor) -> np.ndarray:
    """A torch tensor as numpy, bit for bit (bfloat16 through ml_dtypes, which numpy lacks)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def numpy_to_tensor(array: np.ndarray):
    import torch

    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(array, order="C")  # torch wants writable, contiguous memory
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def by_torch_name(flax_names) -> dict:
    """{torch name: flax name} over the flax model's parameters. Every flax array is one torch tensor (transformers
    keeps Mixtral's experts fused in one parameter too), so a parameter converts on its own, nothing buffered."""
    return {torch_name(name): name for name in flax_names}


def to_flax(flax_name: str, value) -> np.ndarray:
    """One torch tensor (or numpy array) as the flax parameter `flax_name`, bit for bit."""
    return to_flax_layout(flax_name, value if isinstance(value, np.ndarray) else tensor_to_numpy(value))


def require_all(flax_names, present, field: str) -> None:
    """A UserError blaming `field` when a parameter's torch name is not among `present`."""
    missing = [torch_name(n) for n in flax_names if torch_name(n) not in present]
    if missing:
        raise UserError(field, f"the weights lack {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def from_torch(state_dict: dict, flax_names, arch: LlamaArchitecture, field: str = "model.init_from") -> dict:
    """torch state dict (tensors or numpy arrays) -> {flax name: numpy array}; `field` is blamed for a
    missing or inconsistent weight."""
    require_all(flax_names, state_dict, field)
    params = {name: to_flax(name, state_dict[torch_name(name)]) for name in flax_names}
    if arch.tie_word_embeddings and TIED_HEAD in state_dict:
        head = to_flax(TIED_HEAD, state_dict[TIED_HEAD])
        if not np.array_equal(head, params["model.embed_tokens.embedding"]):
            raise UserError(field, "tie_word_embeddings is set but lm_head.weight differs from the embedding")
    return params


def to_torch(params: dict, arch: LlamaArchitecture, with_tied_head: bool = True) -> dict:
    """{flax name: array} -> torch state dict of tensors. `with_tied_head=False` leaves out the tied
    lm_head copy, as Hugging Face checkpoints do."""
    state_dict = {}
    for name, value in params.items():
        array = np.asarray(value)
        state_dict[torch_name(name)] = numpy_to_tensor(to_torch_layout(name, array))
    if arch.tie_word_embeddings and with_tied_head:
        state_dict[TIED_HEAD] = state_dict[EMBEDDING]
    return state_dict


def read_safetensors_dir(directory: pathlib.Path, flax_names, arch: LlamaArchitecture) -> dict:
    """A FULL checkpoint / `save_pretrained` directory -> {flax name: numpy array} (sharded files too)."""
    from safetensors.torch import load_file

    directory = pathlib.Path(directory)
    files = safetensors_shards.weight_files(directory, "train.resume")  # through the index when split
    if not files:
        raise UserError("train.resume", f"{directory} holds no .safetensors weights")
    state_dict = {}
    for file in files:
        state_dict.update(load_file(file))
    return from_torch(state_dict, flax_names, arch, field="train.resume")


def write_safetensors(params: dict, arch: LlamaArchitecture, path: pathlib.Path) -> None:
    """model.safetensors as `save_pretrained` writes it: torch names, no tied lm_head, format "pt"."""
    from safetensors.torch import save_file

    state_dict = to_torch(params, arch, with_tied_head=False)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata={"format": "pt"})
