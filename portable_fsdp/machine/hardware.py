"""The peak-FLOPs rule behind MFU's denominator, the same on every backend. Imports no framework.

The rate one device is credited with: `train.peak_flops_per_device` when set > the datasheet entry for the
device the framework reports and the compute dtype (plan.param_dtype) > a measured matmul. The measurement is
the fallback on CPU, and (with a warning naming train.peak_flops_per_device) on a device or dtype the table
does not know. A backend provides only `device_kind(state)` (the name its framework reports) and
`time_matmul(state, size, dtype)` (the seconds of one product on one device); how the measurement is made is
decided here, once.
"""
from __future__ import annotations

import re
import warnings
from typing import Callable

T = 1e12

# Dense (no 2:4 sparsity) peak FLOP/s per device, from the vendors' datasheets. "bf16" is the tensor-core /
# MXU rate with fp32 accumulation (fp16 is the same on every GPU listed). "fp32" is the plain FP32 rate
# (CUDA cores, no TF32: torch's default for fp32 matmuls); TPUs publish none (XLA computes an fp32 product as
# several bf16 passes, how many depending on the precision asked), so fp32 on a TPU is measured.
# Sources:
#   A100 (SXM4 and PCIe alike): NVIDIA A100 datasheet — BF16 312 TF (624 sparse), FP32 19.5 TF.
#   H100 SXM / PCIe / NVL: NVIDIA H100 datasheet — BF16 989 / 756 / 835 TF (1979 / 1513 / 1671 sparse),
#     FP32 67 / 51 / 60 TF; the SXM figures as computed in https://glennklockwood.com/garden/processors/h100
#     (BF16 matrix 989.4, FP32 66.9).
#   H200 SXM / NVL: NVIDIA H200 datasheet — the H100's compute (BF16 989 / 835 TF, FP32 67 / 60 TF).
#   B200 (HGX, 1000 W): NVIDIA HGX B200 spec, per GPU — BF16 2.25 PF (4.5 sparse), FP32 80 TF
#     (https://glennklockwood.com/garden/processors/B200).
#   L4: NVIDIA L4 datasheet — BF16 242 TF with sparsity, so 121 dense; FP32 30.3 TF.
#   A10: NVIDIA A10 datasheet — BF16 125 TF (250 sparse), FP32 31.2 TF.
#   A10G (AWS's part; NVIDIA publishes no datasheet): BF16 70 TF, FP32 35 TF
#     (https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/).
#   TPU v4 275, v5e 197, v5p 459, v6e (Trillium) 918 TF bf16 per chip: https://cloud.google.com/tpu/docs/v4,
#     /v5e, /v5p-training, /v6e ("Peak compute per chip (bf16)").
# Patterns are tried in order and matched against the lower-cased name the framework reports:
# torch.cuda.get_device_name / jax's device_kind on GPU ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"),
# jax and torch_xla's device kind on TPU ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite").
DATASHEET = (
    (r"\bh100\b.*\bpcie\b", "H100 PCIe", {"bf16": 756 * T, "fp32": 51 * T}),
    (r"\bh100\b.*\bnvl\b", "H100 NVL", {"bf16": 835 * T, "fp32": 60 * T}),
    (r"\bh100\b", "H100 SXM", {"bf16": 989 * T, "fp32": 67 * T}),
    (r"\bh200\b.*\bnvl\b", "H200 NVL", {"bf16": 835 * T, "fp32": 60 * T}),
    (r"\bh200\b", "H200 SXM", {"bf16": 989 * T, "fp32": 67 * T}),
    (r"\bb200\b", "B200", {"bf16": 2250 * T, "fp32": 80 * T}),
    (r"\ba100\b", "A100", {"bf16": 312 * T, "fp32": 19.5 * T}),
    (r"\ba10g\b", "A10G", {"bf16": 70 * T, "fp32": 35 * T}),
    (r"\ba10\b", "A10", {"bf16": 125 * T, "fp32": 31.2 * T}),
    (r"\bl4\b", "L4", {"bf16": 121 * T, "fp32": 30.3 * T}),
    (r"\btpu v4\b|\bv4\b", "TPU v4", {"bf16": 275 * T}),
    (r"\btpu v5 ?lite\b|\bv5e\b|\bv5litepod\b", "TPU v5e", {"bf16": 197 * T}),
    (r"\btpu v5p?\b|\bv5p\b", "TPU v5p", {"bf16": 459 * T}),
    (r"\btpu v6 ?lite\b|\bv6e\b", "TPU v6e", {"bf16": 918 * T}),
)

# Memory per device, for the memory estimate (`python -m portable_fsdp.estimate --device NAME`): the total the
# device reports — nvidia-smi's MiB on GPUs (H100 SXM/PCIe 81559, H200 143771, A100 80GB 81920, A100 40GB 40960),
# HBM per chip on TPUs (https://cloud.google.com/tpu/docs/v4, /v5e, /v5p-training, /v6e: 32, 16, 95, 32 GiB).
# The name is how the framework reports the device, so DATASHEET finds its peak FLOP/s too.
MiB, GiB = 2**20, 2**30
DEVICE_MEMORY = {
    "h100": ("NVIDIA H100 80GB HBM3", 81559 * MiB),
    "h200": ("NVIDIA H200", 143771 * MiB),
    "a100": ("NVIDIA A100-SXM4-80GB", 81920 * MiB),
    "a100-80": ("NVIDIA A100-SXM4-80GB", 81920 * MiB),
    "a100-40": ("NVIDIA A100-SXM4-40GB", 40960 * MiB),
    "v4": ("TPU v4", 32 * GiB),
    "v5e": ("TPU v5 lite", 16 * GiB),
    "v5p": ("TPU v5", 95 * GiB),
    "v6e": ("TPU v6 lite", 32 * GiB),
}

# The link an all-reduce between the devices of one host runs over, in GB/s per direction, from the same
# datasheets: NVLink's total per GPU is bidirectional (H100 / H200 SXM: 18 links, 900 GB/s; A100 SXM: 600 GB/s;
# B200: 1.8 TB/s), so a ring all-reduce's bus bandwidth can reach half of it; PCIe cards talk over PCIe (Gen5 x16:
# 64 GB/s per direction; Gen4 x16: 32 GB/s). TPU v5p: "Bidirectional inter-chip interconnect (ICI) bandwidth per
# chip: 1200 GBps" (https://cloud.google.com/tpu/docs/v5p), over the six links of its 3-D torus: an all-reduce's
# share of it depends on the slice's shape, so no floor is drawn from it.
LINKS = (
    (r"\bh100\b.*\bpcie\b", "PCIe Gen5 x16", 64.0),
    (r"\bh100\b.*\bnvl\b", "PCIe Gen5 x16", 64.0),
    (r"\bh[12]00\b", "NVLink 4 (900 GB/s bidirectional)", 450.0),
    (r"\bb200\b", "NVLink 5 (1.8 TB/s bidirectional)", 900.0),
    (r"\ba100\b.*\bpcie\b", "PCIe Gen4 x16", 32.0),
    (r"\ba100\b", "NVLink 3 (600 GB/s bidirectional)", 300.0),
    (r"\bl4\b|\ba10g?\b", "PCIe Gen4 x16", 32.0),
    (r"\btpu v5(?!e| ?lite)|\bv5p\b", "ICI (1200 GB/s bidirectional per chip)", 1200.0),
)
# What a machine whose measurements fall below these shares of its datasheet has is not what it says (a throttled,
# misconfigured or shared device): the self-test fails it. The link floor applies to NVLink alone.
MATMUL_FLOOR = 0.5
LINK_FLOOR = 0.25

# plan.param_dtype -> datasheet column
_COLUMN = {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32"}

# The measured fallback, the same on every backend: a square product of MEASURE_SIZE (a CPU one big enough to
# use every core, an accelerator one big enough to fill it) in the compute dtype, WARMUP untimed runs (XLA
# compiles on the first, caches warm), then the best of REPEATS. Each timed product runs on every device the
# process drives at once (one operand copy per device): so host CPU devices of one JAX / SPMD process, which
# share its cores, are each credited with their share of the host's rate — the measured rate divided among
# them, as N processes on N cores would be — while accelerators each reach their own.
MEASURE_SIZE = {"cpu": 1024, "accelerator": 8192}
WARMUP = 2
REPEATS = 5


def is_cpu(kind: str) -> bool:
    return kind.strip().lower() == "cpu"


def datasheet_entry(kind: str) -> tuple | None:
    """(name, {column: FLOP/s}) of the first table row whose pattern the device name matches, else None."""
    name = kind.lower()
    for pattern, label, rates in DATASHEET:
        if re.search(pattern, name):
            return label, rates
    return None


def datasheet_flops(kind: str, dtype: str) -> float | None:
    """The datasheet's dense peak for this device in this compute dtype, or None if the table lacks it."""
    entry = datasheet_entry(kind)
    column = _COLUMN.get(dtype)
    return entry[1].get(column) if entry and column else None


def measured_flops(time_matmul: Callable[[int, str], float], kind: str, dtype: str) -> float:
    """The matmul rate one device reaches, measured as described above."""
    size = MEASURE_SIZE["cpu" if is_cpu(kind) else "accelerator"]
    for _ in range(WARMUP):
        time_matmul(size, dtype)
    best = min(time_matmul(size, dtype) for _ in range(REPEATS))
    return 2.0 * size**3 / best


def link_entry(kind: str) -> tuple | None:
    """(link, GB/s per direction) of the first LINKS row the device name matches, else None."""
    name = kind.lower()
    return next(((label, rate) for pattern, label, rate in LINKS if re.search(pattern, name)), None)


# The measured collective: an all-reduce of ALL_REDUCE_BYTES (a GPU's ring reaches its bus bandwidth past a few
# hundred MiB; gloo on a CPU needs far less to show its rate), warmed up and repeated as the matmul is.
ALL_REDUCE_BYTES = {"cpu": 16 * 2**20, "accelerator": 256 * 2**20}


def bus_bandwidth(size: int, seconds: float, devices: int) -> float:
    """An all-reduce's bus bandwidth in bytes/s, as nccl-tests reports it: the bytes each device sends and
    receives over its links, 2 (n - 1) / n of the buffer, per second."""
    return 2.0 * (devices - 1) / devices * size / seconds if devices > 1 else 0.0


def measured_bus_bandwidth(time_all_reduce: Callable[[int], float], kind: str, devices: int) -> float:
    """The all-reduce bus bandwidth over `devices` devices, measured as described above (0 with one device)."""
    if devices < 2:
        return 0.0
    size = ALL_REDUCE_BYTES["cpu" if is_cpu(kind) else "accelerator"]
    for _ in range(WARMUP):
        time_all_reduce(size)
    return bus_bandwidth(size, min(time_all_reduce(size) for _ in range(REPEATS)), devices)


def peak_flops_per_device(configured: float, kind: str, dtype: str,
                          time_matmul: Callable[[int, str], float]) -> float:
    """The denominator of MFU for one device: configured > datasheet > measured (see the module docstring)."""
    if configured:
        return float(configured)
    if not is_cpu(kind):
        listed = datasheet_flops(kind, dtype)
        if listed:
            return listed
        warnings.warn(f"no datasheet peak for {kind!r} in {dtype}: MFU uses a measured matmul rate; set "
                      "train.peak_flops_per_device to the device's dense peak FLOP/s", stacklevel=2)
    return measured_flops(time_matmul, kind, dtype)
