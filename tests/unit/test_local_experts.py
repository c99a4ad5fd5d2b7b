"""A rank's local experts (portable_fsdp/backends/torch/local_experts.py): every kernel gives the outputs and the
gradients of a plain loop over the rows, for uneven routing and for experts without rows, and the kernel is
picked per device, dtype and shape. The CUDA rows of the decision need no GPU: the device type and the compute
capability are injected; the `gpu`-marked test runs the kernel picked for the GPU at hand."""
import pytest
import torch
import torch.nn.functional as F

from portable_fsdp.backends.torch import local_experts
from portable_fsdp.backends.torch.local_experts import GROUPED_MM, SLICES, local_kernel

EXPERTS, HIDDEN, INTERMEDIATE = 4, 16, 8


def gate(gate_up: torch.Tensor) -> torch.Tensor:
    g, up = gate_up.chunk(2, dim=-1)
    return F.silu(g) * up


def weights(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator, requires_grad=True)
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator, requires_grad=True)
    return gate_up, down


def row_by_row(rows, counts, gate_up, down):
    """The definition: each row through its own expert's weights, one row at a time."""
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    return torch.stack([down[e] @ gate(gate_up[e] @ row) for row, e in zip(rows, experts)])


def outputs_and_gradients(compute, counts, device="cpu", dtype=torch.float32):
    """The output and the gradients of rows, gate_up and down (as float32 on the CPU)."""
    rows = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(1))
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (rows, *weights())]
    out = compute(leaves[0], counts, *leaves[1:])
    # a loss weighting every output differently, as the router's weights do
    (out * torch.linspace(-1, 1, out.numel(), device=device, dtype=dtype).view_as(out)).sum().backward()
    return [t.float().cpu() for t in (out, *(leaf.grad for leaf in leaves))]


@pytest.mark.parametrize("kernel", [GROUPED_MM, SLICES])
@pytest.mark.parametrize("counts", [[5, 3, 7, 1], [0, 9, 0, 2], [16, 0, 0, 0], [0, 0, 0, 1]],
                         ids=["uneven", "empty_experts", "one_expert", "one_row"])
def test_each_kernel_computes_the_rows_as_the_definition(kernel, counts):
    expected = outputs_and_gradients(row_by_row, counts)
    got = outputs_and_gradients(lambda *a: local_experts.run(kernel, *a, apply_gate=gate), counts)
    for name, g, e in zip(("output", "rows' gradient", "gate_up's gradient", "down's gradient"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernel", [GROUPED_MM, SLICES])
def test_a_rank_whose_experts_got_no_rows_still_gives_them_a_zero_gradient(kernel):
    """FSDP reduces the same gradients on every rank: experts without any row must have one too (zero)."""
    gate_up, down = weights()
    rows = torch.zeros(0, HIDDEN, requires_grad=True)
    out = local_experts.run(kernel, rows, [0] * EXPERTS, gate_up, down, gate)
    assert out.shape == (0, HIDDEN)
    out.sum().backward()
    assert gate_up.grad is not None and not gate_up.grad.any() and down.grad is not None and not down.grad.any()


A100, H100, B200, RTX5090 = (8, 0), (9, 0), (10, 0), (12, 0)
BF16, FP32 = torch.bfloat16, torch.float32
QWEN3 = (2048, 768, 1536)  # hidden, moe intermediate, 2 × intermediate


@pytest.mark.parametrize("device, dtype, dims, capability, kernel", [
    ("cuda", BF16, QWEN3, H100, GROUPED_MM),  # the grouped kernel
    ("cuda", BF16, QWEN3, B200, GROUPED_MM),
    ("cuda", BF16, QWEN3, A100, SLICES),  # torch would loop and copy the offsets to the host
    ("cuda", BF16, QWEN3, RTX5090, SLICES),
    ("cuda", FP32, QWEN3, H100, SLICES),  # the grouped kernel is bfloat16 only
    ("cuda", BF16, (2048, 100, 200), H100, SLICES),  # 200 bytes: not a multiple of 16
    ("cpu", FP32, (64, 32, 64), None, GROUPED_MM),  # torch's CPU loop
    ("cpu", BF16, (64, 33, 66), None, SLICES),
    ("cpu", FP32, (64, 2, 4), None, SLICES),  # 8 bytes
    ("mps", FP32, QWEN3, None, SLICES),
])
def test_the_kernel_is_picked_from_device_dtype_and_shape(device, dtype, dims, capability, kernel):
    assert local_kernel(device, dtype, dims, capability) == kernel


@pytest.mark.parametrize("kernel", [GROUPED_MM, SLICES])
def test_each_kernel_executes_six_flops_per_routed_row_and_weight(kernel):
    """Forward 2, backward 4 (the rows' and the weights' gradients) per weight of the expert a row went to: no
    padding, no expert a row was not sent to (torch's counter with the grouped GEMM's formula from executed_flops)."""
    from torch.utils.flop_counter import FlopCounterMode

    from portable_fsdp.backends.torch.executed_flops import FORMULAS

    counts = [5, 0, 9, 2]
    gate_up, down = weights()
    rows = torch.randn(sum(counts), HIDDEN, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=FORMULAS) as counter:
        out = local_experts.run(kernel, rows, counts, gate_up, down, gate)
        out.backward(torch.ones_like(out))
    assert counter.get_total_flops() == 6 * sum(counts) * 3 * HIDDEN * INTERMEDIATE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_kernel_picked_for_this_gpu_computes_the_rows_as_the_definition():
    """bfloat16 on the GPU (torch's grouped kernel on Hopper / Blackwell, the slices elsewhere) against the CPU's
    float32 definition, within bfloat16's rounding."""
    counts = [40, 0, 24, 8]
    expected = outputs_and_gradients(row_by_row, counts)
    kernel = local_kernel("cuda", torch.bfloat16, (HIDDEN, INTERMEDIATE, 2 * INTERMEDIATE))

    got = outputs_and_gradients(lambda *a: local_experts.run(kernel, *a, apply_gate=gate), counts, "cuda",
                                torch.bfloat16)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)

