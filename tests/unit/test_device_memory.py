"""What the torch lowering reports of a GPU's memory, decided with the GPU's counters injected (no GPU here): the
caching allocator's allocated and reserved bytes, and the driver's view for the base (the CUDA context and NCCL's
buffers, which no allocator counter sees). On the CPU every figure is the process's resident set."""
import torch

from portable_fsdp.machine import host_memory
from portable_fsdp.backends.torch import resources

MiB, GiB = 2**20, 2**30


def test_a_gpu_reports_what_its_allocator_holds_beside_what_tensors_hold(monkeypatch):
    counters = {"memory_allocated": 3 * MiB, "max_memory_allocated": 5 * MiB, "memory_reserved": 8 * MiB,
                "max_memory_reserved": 10 * MiB}
    asked = []
    for name, value in counters.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: asked.append(device) or value)
    gpu = torch.device("cuda", 1)
    assert resources.memory_mb(gpu) == {"mem_mb": 3.0, "peak_mem_mb": 5.0, "reserved_mb": 8.0,
                                        "peak_reserved_mb": 10.0}
    assert set(asked) == {gpu}  # this rank's GPU, not GPU 0


def test_a_gpus_base_is_what_the_driver_has_handed_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GiB, 80 * GiB))
    assert resources.in_use_mb(torch.device("cuda", 0)) == 10 * 1024.0
    assert resources.shared_mb(torch.device("cuda", 0)) == 0.0


def test_the_cpu_reports_the_resident_set_for_every_figure(monkeypatch):
    monkeypatch.setattr(host_memory, "resident_mb", lambda: 700.0)
    monkeypatch.setattr(host_memory, "peak_resident_mb", lambda: 900.0)
    assert resources.memory_mb(torch.device("cpu")) == {"mem_mb": 700.0, "peak_mem_mb": 900.0, "reserved_mb": 700.0,
                                                        "peak_reserved_mb": 900.0}
    assert resources.in_use_mb(torch.device("cpu")) == 700.0
