"""What a GPU run meets that the CPU tests never executed, reproduced on the CPU where the mechanism allows —
each check fails without its fix:

- a FULL save or export under plan.cpu_offload gathers shards that live in host memory while their mesh is the
  GPUs'; NCCL has no CPU backend (a process group with gloo registered for CUDA tensors only stands for it): the
  shard is moved to its mesh's device first;
- non-persistent buffers broadcast from rank 0 (cpu_ram_efficient_loading) in the iteration order of a set of
  names, which differs between processes (salted string hashes);
- context- and sequence-parallel attention recomputed by activation checkpointing in the backward, which a CUDA
  backward runs on autograd's own thread;
- host memory pinned from a thread that never chose its CUDA device, and a spawned writer process that sees the
  GPUs (both open a CUDA context on GPU 0): where no GPU exists, the decision is tested with the device injected;
- the FSDP units of a CUDA run, which prefetch each other's all-gathers: built on gloo with the device injected.
"""
import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.common import free_port
from portable_fsdp.backends.torch import checkpoint, save_process
from portable_fsdp.backends.torch.model import place_buffers
from portable_fsdp.backends.torch.step import state_device
from portable_fsdp.plan import ShardingPlan
from tests.conftest import ROOT
from tests.dist.launch import torchrun

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerator") / "found.json"
    torchrun(2, os.path.join(HERE, "accelerator_paths_check.py"), str(out), timeout=600)
    return json.loads(out.read_text())


def test_an_offloaded_shard_is_gathered_on_its_meshs_device(found):
    gpu_mesh = found["cpu_piece_on_a_gpu_mesh"]
    assert gpu_mesh["gather_error"] == "No backend type associated with device type cpu"  # what NCCL raises
    assert gpu_mesh["gather_device"] == "cuda"  # where dtensors.full_value moves the piece before gathering
    on_cpu = found["offloaded_parameter_gathered"]
    assert on_cpu == {"gather_device": None, "equal": True}  # gloo's CPU mesh: gathered where it is, whole


@pytest.mark.parametrize("kind", ["cp", "sp"])
def test_sequence_sharded_attention_recomputes_on_autograds_thread(found, kind):
    result = found[f"{kind}_backward_on_another_thread"]
    assert result["failure"] == ""
    assert result["same_gradients"] and result["parameters"] == 21


def test_cuda_layers_prefetch_their_neighbours_and_the_last_stays_gathered(found):
    """With the device injected, the cuda lowering's units: each layer starts the next one's all-gather in forward
    and the previous one's in backward, the last keeps its parameters from forward to backward; the cpu
    lowering's keep FSDP2's defaults. The gradients are the same."""
    overlap = found["cuda_overlap_on_gloo"]
    layers = len(overlap["cuda"]["forward_prefetch"])
    assert layers >= 2
    assert overlap["cuda"]["forward_prefetch"] == [[i + 1] for i in range(layers - 1)] + [[]]
    assert overlap["cuda"]["backward_prefetch"] == [[]] + [[i] for i in range(layers - 1)]
    assert overlap["cuda"]["reshard_after_forward"] == [True] * (layers - 1) + [False]
    assert overlap["cpu"]["forward_prefetch"] == overlap["cpu"]["backward_prefetch"] == [[]] * layers
    assert overlap["cpu"]["reshard_after_forward"] == [True] * layers
    assert overlap["cpu"]["failure"] == overlap["cuda"]["failure"] == ""
    assert overlap["same_gradients"]


def _set_order(seed: int) -> str:
    code = "print(list({'sliding_attention_inv_freq', 'full_attention_inv_freq'}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout


def test_computed_buffers_reach_their_own_names_whatever_each_process_hashes():
    first = _set_order(0)
    seed = next(s for s in range(1, 64) if _set_order(s) != first)  # two processes that iterate the set apart
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "buffer_order_check.py")], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, "PYTHONHASHSEED": str(hash_seed),
                                   "PYTHONPATH": str(ROOT)})
             for rank, hash_seed in enumerate((0, seed))]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    received = outputs[1][0].strip().splitlines()[-1]  # (after gloo's connection banner)
    assert received.split() == ["sliding_attention_inv_freq=1", "full_attention_inv_freq=2"]


def test_offloaded_state_lives_in_host_memory_and_buffers_where_the_model_computes():
    """Decided with the GPU injected: parameters, gradients and AdamW's state in host memory under cpu_offload;
    buffers (rotary tables) where the layers run, so that every rank's broadcast is on the group's device."""
    gpu = torch.device("cuda", 3)
    assert state_device(ShardingPlan(cpu_offload=True), gpu) == torch.device("cpu")
    assert state_device(ShardingPlan(cpu_offload=False), gpu) == gpu
    model = torch.nn.Linear(3, 2)
    model.register_buffer("inv_freq", torch.ones(2), persistent=False)
    place_buffers(model, torch.device("meta"))  # a device other than the parameters', as a GPU would be
    assert model.inv_freq.device.type == "meta" and model.weight.device.type == "cpu"


def test_the_staging_thread_takes_its_ranks_gpu(monkeypatch):
    """Pinning host memory from a thread opens a CUDA context on that thread's current device, GPU 0 unless it
    chose one: the staging thread sets its rank's device first (recorded here; no GPU to set)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(torch.device(device)))
    device = torch.device("cuda", 5)
    checkpoint._staging_thread(device).submit(lambda: None).result()
    checkpoint._staging_thread.cache_clear()
    assert chosen == [device]


def _report_gpus(queue) -> None:
    queue.put(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_the_checkpoint_writer_process_sees_no_gpu(monkeypatch):
    """The spawned writer writes host memory only; seeing a GPU, dcp's writer would open a context on GPU 0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_report_gpus, args=(queue,))
    with save_process._no_gpus_for_children():
        child.start()
    child.join(60)
    assert queue.get(timeout=10) == "" and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
