"""A rank's own experts on the rows routed to them: transformers' gated MLP, down(act(gate) * up), computed for
those rows only — never for an expert a row was not sent to, never on padding. The rows arrive sorted by expert
(`counts[e]` rows for local expert e), so every expert's rows are one contiguous slice.

Two kernels compute the same products; `local_kernel` picks one from the device, the dtype and the shapes:
- `grouped_mm`: torch's grouped GEMM, one call per projection for every expert at once, its offsets the
  cumulative row counts (int32, made from the host's counts: no device-to-host copy). On CUDA, torch 2.9 runs it
  on a grouped kernel of its own when both operands are bfloat16 on a Hopper or Blackwell datacenter GPU (compute
  capability 9.x or 10.x); otherwise it loops over the experts itself after copying the offsets to the host. On the
  CPU its kernel is that loop, in C++: measured fwd+bwd, fp32 and bf16, 2 to 64 experts, it was as fast as the
  slices below or faster (8 experts of 512×512 on 1024 rows: 217 vs 270 ms). Every operand's row stride must be
  a multiple of 16 bytes on any device.
- `slices`: one matrix product per projection for each expert that received rows, on its contiguous slice; the
  weights are unbound once (indexing the [E, ...] weight per expert costs a full-size gradient per expert in
  backward: 30× slower at 64 experts). Any shape, any device.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

GROUPED_MM, SLICES = "grouped_mm", "slices"
# Compute capabilities (major) whose bfloat16 grouped GEMM torch 2.9 runs on a kernel of its own.
GROUPED_KERNEL_MAJORS = (9, 10)
# torch's grouped GEMM takes matrices whose row strides are multiples of 16 bytes (TMA transfers).
STRIDE_BYTES = 16


def local_kernel(device_type: str, dtype: torch.dtype, dims: tuple, capability: tuple | None = None) -> str:
    """The kernel for local experts on `device_type` in `dtype` whose matrices have `dims` columns (hidden size,
    intermediate size, twice the intermediate size). `capability`: the CUDA device's (major, minor), read from
    the current device when not given; the decision for any GPU is testable on a CPU machine by injecting it."""
    if not all(d * dtype.itemsize % STRIDE_BYTES == 0 for d in dims):
        return SLICES  # torch's grouped GEMM refuses the strides
    if device_type == "cpu":
        return GROUPED_MM
    if device_type != "cuda" or dtype != torch.bfloat16:
        return SLICES
    if capability is None:
        capability = torch.cuda.get_device_capability()
    # elsewhere torch's grouped GEMM loops as `slices` does, after a device-to-host copy of the offsets
    return GROUPED_MM if capability[0] in GROUPED_KERNEL_MAJORS else SLICES


def run(kernel: str, rows: torch.Tensor, counts: list, gate_up: torch.Tensor, down: torch.Tensor,
        apply_gate) -> torch.Tensor:
    """Experts' outputs for `rows` sorted by expert, `counts[e]` of them for expert e: gate_up [E, 2I, H] and
    down [E, H, I] stored [out, in]; `apply_gate` maps the [gate; up] rows to act(gate) * up."""
    if not rows.shape[0]:  # nothing to multiply (and torch's grouped GEMM refuses the empty gradient's strides)
        kernel = SLICES
    return KERNELS[kernel](rows, counts, gate_up, down, apply_gate)


def _grouped_mm(rows, counts, gate_up, down, apply_gate):
    # Its backward takes an output gradient with 16-byte row strides only, not an expanded one: expert_parallel
    # indexes the output, whose gradient is then a fresh tensor.
    offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)
    hidden = apply_gate(torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets))
    return torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offsets)


def _slices(rows, counts, gate_up, down, apply_gate):
    # An expert without rows is skipped; with none at all, the first runs on no rows, so that the weights'
    # gradient (zero) exists on every rank alike: FSDP reduces the same tensors everywhere.
    used = [e for e, n in enumerate(counts) if n] or [0]
    starts = [0, *itertools.accumulate(counts)]
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    return torch.cat([F.linear(apply_gate(F.linear(rows[starts[e]:starts[e + 1]], gate_ups[e])), downs[e])
                      for e in used])


KERNELS = {GROUPED_MM: _grouped_mm, SLICES: _slices}
