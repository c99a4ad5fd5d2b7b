"""Run under torchrun (gloo, 2 ranks): the mechanisms behind failures that a GPU run meets, reproduced on the CPU,
and what the torch lowering does about each. Writes rank 0's findings to JSON.

- a DTensor whose local piece is in host memory while its mesh is a GPU mesh (FSDP2's CPU offload): a process
  group with no CPU backend stands for NCCL ("cuda:gloo": gloo registered for CUDA tensors only);
- an offloaded FSDP2 parameter gathered whole (dtensors.full_value), as FULL saves and the export do;
- context- and sequence-parallel attention recomputed (activation checkpointing) by a backward that runs on
  another thread than the forward, as autograd's per-device thread runs a CUDA backward;
- the FSDP units the cuda lowering builds (layers prefetching each other's all-gathers, the last one kept
  gathered), built on gloo with "cuda" passed in.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/accelerator_paths_check.py OUT.json
"""
import contextlib
import json
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
from torch.distributed.tensor import Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from portable_fsdp.backends.hf_torch import model as model_lib
from portable_fsdp.backends.hf_torch.loss import token_loss_sum
from portable_fsdp.backends.torch import dtensors, sequence_parallel
from portable_fsdp.backends.torch.context_parallel import CPGroup, apply_context_parallel, sequence_shard
from portable_fsdp.backends.torch.mesh import build_meshes
from portable_fsdp.backends.torch.parallelize import apply_activation_checkpointing, apply_fsdp
from portable_fsdp.config.validate import plan_from_config
from portable_fsdp.data.batch import Batch
from tests.parity.matrix import make_config


def cpu_piece_on_a_gpu_mesh() -> dict:
    group = dist.new_group(backend="cuda:gloo")  # like NCCL: no backend for CPU tensors
    mesh = DeviceMesh.from_group(group, "cuda")
    local = torch.full((2,), float(dist.get_rank()))
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([4]), (1,), torch.float32))
    offloaded = _from_local_no_grad(local, spec)  # as FSDP2 builds its sharded parameters
    try:
        offloaded.full_tensor()
        error = ""
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    return {"gather_error": error, "gather_device": dtensors.gather_device(offloaded)}


def offloaded_parameter_gathered() -> dict:
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 5)
    full = layer.weight.detach().clone()
    fully_shard(layer, mesh=init_device_mesh("cpu", (2,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
    return {"gather_device": dtensors.gather_device(layer.weight),
            "equal": torch.equal(dtensors.full_value(layer.weight), full)}


def gradients(model, batch, attach, backward_elsewhere: bool) -> dict:
    """Parameter gradients of one forward and backward of `batch` under `attach` (sequence_shard); the backward
    in another thread when `backward_elsewhere`."""
    model.zero_grad(set_to_none=True)
    failure = []
    with attach(batch) as (input_ids, labels, positions):
        loss = token_loss_sum(model, input_ids, labels, positions)

        def backward():
            try:
                loss.backward()
            except Exception as err:  # reported, so the check says what failed
                failure.append(f"{type(err).__name__}: {err}")

        if backward_elsewhere:
            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
        else:
            backward()
    return {"failure": failure[0] if failure else "",
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def attention_recomputed_on_another_thread(kind: str) -> dict:
    config = make_config({})
    model = model_lib.create_model(config, 0, False)
    group = dist.group.WORLD
    if kind == "cp":
        cp = CPGroup(group=group, mesh=init_device_mesh("cpu", (2,)), cp_rank=dist.get_rank(), cp_size=2,
                     rotate_method="allgather", impl="portable", load_balance=True)
        apply_context_parallel(model, cp)
        attach = lambda batch: sequence_shard(cp, batch, torch.device("cpu"))  # noqa: E731
    else:
        sp = sequence_parallel.SPGroup(group=group, sp_rank=dist.get_rank(), sp_size=2)
        sequence_parallel.apply_sequence_parallel(model, sp)
        attach = lambda batch: sequence_parallel.sequence_shard(sp, batch, torch.device("cpu"))  # noqa: E731
    apply_activation_checkpointing(model, ("LlamaDecoderLayer",))
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1)).numpy()
    batch = Batch(input_ids=tokens[:, :-1].copy(), labels=tokens[:, 1:].copy())
    here = gradients(model, batch, attach, backward_elsewhere=False)
    elsewhere = gradients(model, batch, attach, backward_elsewhere=True)
    same = not elsewhere["failure"] and all(torch.equal(here["grads"][n], g) for n, g in elsewhere["grads"].items())
    return {"failure": elsewhere["failure"], "same_gradients": same, "parameters": len(elsewhere["grads"])}


def cuda_overlap_on_gloo() -> dict:
    """Per layer, for the units `apply_fsdp` builds with device type cpu and cuda: the layers it prefetches in
    forward and in backward, whether it reshards after forward, and whether one forward and backward gives the
    cpu units' gradients (this rank's shards; gloo's collectives under both)."""
    config = make_config({"plan.cpu_collectives": "gloo"})
    plan = plan_from_config(config)
    meshes = build_meshes(plan.mesh.resolve(2), "cpu")
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    inputs = contextlib.nullcontext((tokens[:, :-1], tokens[:, 1:], None))
    found, grads = {}, {}
    for device_type in ("cpu", "cuda"):
        model = model_lib.create_model(config, 0, False)
        layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]  # fully_shard renames it
        apply_fsdp(model, plan, meshes, ("LlamaDecoderLayer",), device_type)
        states = [layer._get_fsdp_state() for layer in layers]
        found[device_type] = {
            "forward_prefetch": [[states.index(t) for t in s._states_to_forward_prefetch] for s in states],
            "backward_prefetch": [[states.index(t) for t in s._states_to_backward_prefetch] for s in states],
            "reshard_after_forward": [s._fsdp_param_group.post_forward_mesh_info is not None for s in states]}
        result = gradients(model, None, lambda _: inputs, backward_elsewhere=False)
        found[device_type]["failure"] = result["failure"]
        grads[device_type] = {n: g.to_local() for n, g in result["grads"].items()}
    found["same_gradients"] = bool(grads["cpu"]) and grads["cpu"].keys() == grads["cuda"].keys() and all(
        torch.equal(g, grads["cuda"][n]) for n, g in grads["cpu"].items())
    return found


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {"cpu_piece_on_a_gpu_mesh": cpu_piece_on_a_gpu_mesh(),
               "offloaded_parameter_gathered": offloaded_parameter_gathered(),
               "cp_backward_on_another_thread": attention_recomputed_on_another_thread("cp"),
               "sp_backward_on_another_thread": attention_recomputed_on_another_thread("sp"),
               "cuda_overlap_on_gloo": cuda_overlap_on_gloo()}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
