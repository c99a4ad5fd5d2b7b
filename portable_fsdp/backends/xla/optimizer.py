"""The optimizer over the sharded parameters, and global-norm clipping computed on the device.

The same optimizer as the torch backend (hf_torch.optimizer: `train.optimizer`'s, decay only on parameters that
are at least 2-D, here with the single-tensor kernels: the fused and foreach ones reject or mishandle xla
tensors). Decay is decided on each
parameter's original shape, since FSDP v1 hands the optimizer flat 1-D shards.
"""
from __future__ import annotations

import torch
import torch_xla

from portable_fsdp.backends.hf_torch import optimizer as torch_optimizers
from portable_fsdp.backends.xla import runtime as rt


def build_optimizer(named: list, train_cfg, factory=None) -> torch.optim.Optimizer:
    """Over the parameters the wrappers left (their shards), decaying by each one's original shape; `factory`: a
    user's, in place of train.optimizer's."""
    return torch_optimizers.build_optimizer(((n.param, len(n.shape)) for n in named), train_cfg, "xla", factory)


def prime_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state now, as its first step would (step 0, zero moments), each moment sharded like its
    parameter. Then the first step traces the same graph as every later one (one compilation, not two), and a
    sharded checkpoint has tensors to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            sharding = torch_xla._XLAC._get_xla_op_sharding(p)
            state = optimizer.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # host scalar, as torch keeps it without capturable
            for key in ("exp_avg", "exp_avg_sq"):
                moment = torch.zeros_like(p, memory_format=torch.preserve_format)
                if sharding:
                    torch_xla._XLAC._xla_mark_sharding(moment, sharding)
                state[key] = moment


def shard_gradients_like_parameters(params: list) -> None:
    """Lay each gradient out like its parameter (and so its AdamW moments) before the step graph ends. Left to
    itself XLA picks a gradient's layout from the backward (under sequence or tensor parallelism often another
    dimension or axis), and the update graph would then move every such gradient across devices again."""
    for p in params:
        sharding = torch_xla._XLAC._get_xla_op_sharding(p)
        if p.grad is not None and sharding:
            torch_xla._XLAC._xla_mark_sharding(p.grad, sharding)


def clip_grad_norm(runtime: rt.Runtime, params: list, max_norm: float) -> torch.Tensor:
    """The global L2 norm of every gradient (a device scalar, nothing read back) and torch's clipping
    formula: scale by max_norm / (norm + 1e-6) when that is below 1."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    norm = rt.device_sum(runtime, squares).sqrt()
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coefficient)
    return norm
