"""`torchtitan.train` on CPU ranks (gloo), for benchmarks/peers.py; run by torchtitan's own Python under torchrun.

torchtitan 0.3.0 assumes an accelerator: it takes `_get_available_device_type() or "cuda"` as its device (hence
nccl and torch.cuda.set_device), asks that device's module for memory statistics, and sets FSDP's gradient divide
factor to 1.0, which makes FSDP2 reduce with PREMUL_SUM, an op gloo refuses. The patches below make the device
"cpu" (gloo), give torch.cpu the memory calls torchtitan makes (reporting the resident set), and reduce with a
plain SUM (the same result). With SDPA attention (llama_config.py) the per-document positions its data loader
emits are dropped, so that RoPE runs 0..L-1 over the packed sequence as ours does by default."""
import os
import resource
import runpy
import sys

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"


class _CpuDeviceModule:
    """torch.cpu plus the calls torchtitan makes on its device module (peak memory: this rank's resident set)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def current_device(self):
        return 0  # torch.cpu's is the string "cpu"; barrier(device_ids=[...]) wants an int

    def device_count(self):
        return 1

    def set_device(self, *args, **kwargs):
        return None

    def get_device_name(self, *args, **kwargs):
        return "cpu"

    def get_device_properties(self, *args, **kwargs):
        return type("Properties", (), {"total_memory": self.total})()

    def reset_peak_memory_stats(self, *args, **kwargs):
        return None

    def empty_cache(self, *args, **kwargs):
        return None

    def memory_stats(self, *args, **kwargs):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": rss, "reserved_bytes.all.peak": rss, "num_alloc_retries": 0, "num_ooms": 0}


_device_module = torch._utils._get_device_module
torch._utils._get_device_module = lambda kind="cuda": _CpuDeviceModule() if kind == "cpu" else _device_module(kind)

import torchtitan.distributed.fsdp as titan_fsdp  # noqa: E402  (after the device patch, which it reads on import)
import torchtitan.trainer as titan_trainer  # noqa: E402

_disable_division = titan_fsdp.disable_fsdp_gradient_division


def _sum_reduction(model):
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, titan_fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


titan_fsdp.disable_fsdp_gradient_division = _sum_reduction
_post_dataloading = titan_trainer.Trainer.post_dataloading_process


def _without_positions(self, input_dict, labels):
    return _post_dataloading(self, {k: v for k, v in input_dict.items() if k != "positions"}, labels)


titan_trainer.Trainer.post_dataloading_process = _without_positions
sys.argv[0] = "torchtitan.train"
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
