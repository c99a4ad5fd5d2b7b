"""Memory of one training step per device for the torch_xla lowering: an analytical estimate, not a compiled
one. torch_xla compiles only for devices its runtime has started (and would allocate real weights to trace
the step), so nothing is compiled here:

- parameters, gradients and AdamW's two moments: float32 (torch_xla keeps float32 masters; bfloat16 is its
  autocast), each parameter's shard as portable_fsdp/backends/xla/layout.py places it on the plan's SPMD mesh (the partition
  specs the lowering applies: the dimension split over fsdp × ep × cp × sp × tp, rounded up), or — FSDP v1
  (plan.xla_fsdp_v2=false) — its flat shard over every process;
- activations, gathered weights and temporaries: those of the same transformers model, with the same plan,
  rows and tokens per device, traced under the torch lowering (portable_fsdp/backends/torch/estimate.py): the model code
  torch_xla traces is the same, but XLA fuses, schedules and frees buffers itself, and its autocast keeps some
  activations (norms, softmax) in float32 where FSDP2's mixed precision computes in bfloat16.
"""
from __future__ import annotations

import math
import re

import torch

from portable_fsdp import placement
from portable_fsdp.backends.hf_torch import model as model_lib
from portable_fsdp.backends.torch import estimate as torch_estimate
from portable_fsdp.backends.xla import layout
from portable_fsdp.config.schema import from_dict
from portable_fsdp.mesh_fit import tensor_parallel_plan
from portable_fsdp.config.validate import resolve_plan

FLOAT32 = 4


METHOD = ("analytical: torch_xla's float32 state from its SPMD partition specs; activations traced from the same "
          "model under torch FSDP2 (torch_xla is not compiled)")


def estimate_memory(request: dict) -> dict:
    """The backend contract's estimate (portable_fsdp/backend.py): one device stands for all (SPMD)."""
    config_dict, world_size = request["config"], request["world"]
    config = from_dict(config_dict)
    plan = resolve_plan(config, world_size)
    held = state_per_device(config, plan)
    traced = torch_estimate.estimate_ranks(config_dict, world_size, request["ranks"][:1], "cpu")
    rank = traced["ranks"][0]
    at_peak = {**rank["at_peak"], "parameters": held["parameters"], "optimizer": held["optimizer"]}
    if rank["held"]["gradients"]:  # the share of the gradients alive at the traced peak
        at_peak["gradients"] = held["gradients"] * rank["at_peak"]["gradients"] // rank["held"]["gradients"]
    return {**traced, "same_on_every_device": True, "method": METHOD,
            "ranks": [{**rank, "rank": 0, "peak": sum(at_peak.values()), "at_peak": at_peak, "held": held}]}


def state_per_device(config, plan) -> dict:
    """Bytes one device holds of parameters, gradients and AdamW's moments (float32)."""
    cfg = model_lib.hf_config(config.model)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    info = model_lib.describe_model(config)
    frozen = [re.compile(pattern.strip()) for pattern in config.train.freeze if pattern.strip()]
    trained = {name for name, _ in model.named_parameters() if not any(r.search(name) for r in frozen)}
    if plan.xla.xla_fsdp_v2:
        sizes = placement.axis_sizes(plan.mesh)
        tp_plan = tensor_parallel_plan(plan, info) if plan.mesh.tp_size > 1 else {}
        specs = layout.parameter_specs(model, tp_plan, info.num_experts if plan.mesh.ep_size > 1 else 0, plan.mesh)
        shard = {name: math.prod(_shard_shape(tuple(p.shape), specs[name], sizes))
                 for name, p in model.named_parameters()}
    else:
        world = plan.mesh.data_parallel_size
        shard = {name: -(-p.numel() // world) for name, p in model.named_parameters()}
    parameters = sum(shard.values()) * FLOAT32
    gradients = sum(n for name, n in shard.items() if name in trained) * FLOAT32
    return {"parameters": parameters, "gradients": gradients, "optimizer": 2 * gradients}


def _shard_shape(shape: tuple, spec: tuple, sizes: dict) -> tuple:
    """Each dimension divided (rounded up) by the product of the mesh axes its spec entry names."""
    out = []
    for dim, entry in zip(shape, spec or (None,) * len(shape)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(-(-dim // math.prod(sizes[a] for a in axes)))
    return tuple(out)
