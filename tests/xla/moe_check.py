"""One tiny Mixtral experts layer run by the xla backend's experts (expert_blocks.py; expert_dispatch.py under expert
parallelism) on PJRT CPU devices, against transformers' own experts in plain torch on the host; writes JSON.

    python tests/xla/moe_check.py OUT.json DEVICES EP_SIZE TP_SIZE

Reports the largest differences of the output and of the gradients (tokens, router weights, both expert weights),
and from the compiled, partitioned step (XLA's dump of the optimized HLO): its collectives — each all-gather's result
shape, and how many all-to-alls, collective-permutes, all-reduces and reduce-scatters it runs — and the matmul FLOPs
each device executes.
"""
import copy
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from portable_fsdp.backends.xla import environment  # noqa: E402  (imports no torch_xla)

OUT, DEVICES, EP_SIZE, TP_SIZE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
environment.configure(DEVICES)
os.environ.setdefault("PJRT_DEVICE", "CPU")
DUMP = tempfile.mkdtemp(prefix="moe-hlo-")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from transformers.integrations.moe import batched_mm_experts_forward  # noqa: E402

from portable_fsdp import placement  # noqa: E402
from portable_fsdp.backends.xla import expert_blocks, expert_dispatch, layout  # noqa: E402
from portable_fsdp.plan import MeshSpec  # noqa: E402
from tests.xla.helpers import tiny_experts  # noqa: E402

TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 16, 24, 4, 2
COLLECTIVES = ("all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def layer_inputs():
    """Seeded experts, token states, router choices (expert 0 chosen by no token, expert 1 by every token) and
    router weights, on the host."""
    experts = tiny_experts(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K)
    hidden = torch.randn(TOKENS, HIDDEN)
    second = torch.randint(2, EXPERTS, (TOKENS,))
    top_k_index = torch.stack([torch.ones_like(second), second], dim=1)
    top_k_weights = torch.rand(TOKENS, TOP_K)
    return experts, hidden, top_k_index, top_k_weights


def output_and_grads(experts, hidden, top_k_index, top_k_weights, forward, cotangent):
    hidden, top_k_weights = hidden.clone().requires_grad_(), top_k_weights.clone().requires_grad_()
    out = forward(experts, hidden, top_k_index, top_k_weights)
    (out * cotangent).sum().backward()
    return [t.detach() for t in (out, hidden.grad, top_k_weights.grad, experts.gate_up_proj.grad,
                                 experts.down_proj.grad)]


def on_mesh(experts, hidden, top_k_index, top_k_weights, cotangent):
    """The xla run: weights placed as the backend places them, token rows over the data-parallel devices."""
    spec = MeshSpec(ep_size=EP_SIZE, tp_size=TP_SIZE).resolve(DEVICES)
    mesh = xs.Mesh(np.arange(DEVICES), layout.mesh_shape(spec), placement.MESH_AXES)
    sizes = placement.axis_sizes(spec)
    device = torch_xla.device()
    experts = experts.to(device)
    for parameter in experts.parameters():
        xs.mark_sharding(parameter, mesh, layout.parameter_spec(tuple(parameter.shape), sizes, expert=EP_SIZE > 1))
    rows = (placement.DATA_AXES + placement.SEQUENCE_AXES, None)
    hidden, top_k_index, top_k_weights, cotangent = (xs.mark_sharding(t.to(device), mesh, rows).global_tensor
                                                     for t in (hidden, top_k_index, top_k_weights, cotangent))
    if EP_SIZE > 1:
        def forward(*args):
            return expert_dispatch.dispatching_forward(*args, mesh=mesh)
    else:
        forward = expert_blocks.experts_forward
    results = output_and_grads(experts, hidden, top_k_index, top_k_weights, forward, cotangent)
    torch_xla.sync()
    return [t.cpu() for t in results]


def step_program() -> str:
    """The compiled step's optimized HLO: the largest module XLA dumped."""
    return max((p.read_text() for p in pathlib.Path(DUMP).glob("*after_optimizations.txt")), key=len)


def dot_flops(step: str) -> int:
    """FLOPs of every dot in one device's program: 2 x the result's elements x the contracted length (read from
    the left operand's shape, which the instruction defining it states)."""
    shapes = {name: dims for name, dims in re.findall(r"%(\S+) = \w+\[([\d,]*)\]", step)}
    total = 0
    for result, lhs, contracted in re.findall(
            r"= \w+\[([\d,]*)\]\S* dot\(%([^,]+),[^)]*\).*?lhs_contracting_dims=\{([\d,]*)\}", step):
        lhs_dims = [int(d) for d in shapes[lhs].split(",") if d]
        elements = math.prod(int(d) for d in result.split(",") if d)
        total += 2 * elements * math.prod(lhs_dims[int(i)] for i in contracted.split(",") if i)
    return total


def collectives(step: str) -> dict:
    """The collectives of the compiled step program."""
    result = r"= (\([^)]*\)|\S+) "  # one shape, or a tuple of them
    found = {name: len(re.findall(rf"{result}{name}(?:-start)?\(", step)) for name in COLLECTIVES}
    found["all-gather"] = [re.sub(r"\{[\d,]*\}", "", shape)  # without the layouts
                           for shape in re.findall(rf"{result}all-gather(?:-start)?\(", step)]
    return found


def main() -> None:
    try:
        check()
    finally:
        shutil.rmtree(DUMP, ignore_errors=True)


def check() -> None:
    xr.use_spmd()
    experts, hidden, top_k_index, top_k_weights = layer_inputs()
    cotangent = torch.randn(TOKENS, HIDDEN)
    # xla first: torch's autograd engine sizes its device queues at its first backward
    ours = on_mesh(copy.deepcopy(experts), hidden, top_k_index, top_k_weights, cotangent)
    reference = output_and_grads(experts, hidden, top_k_index, top_k_weights, batched_mm_experts_forward, cotangent)
    names = ("output", "hidden_grad", "router_weight_grad", "gate_up_proj_grad", "down_proj_grad")
    sources = DEVICES if EP_SIZE > 1 else 1  # under ep every device dispatches its own tokens
    shape = expert_blocks.Shape(TOKENS // sources, TOP_K, EXPERTS, EP_SIZE, sources)
    step = step_program()
    # an expert row costs 3 matmuls of H x I, forward (2 FLOPs a product) and backward (twice that): 18 H I
    executed_rows = DEVICES * dot_flops(step) / (18 * HIDDEN * INTERMEDIATE)
    result = {"differences": {n: float((a - b).abs().max()) for n, a, b in zip(names, ours, reference)},
              "collectives": collectives(step), "tokens": TOKENS, "experts": EXPERTS,
              "executed_rows": executed_rows, "slots": sources * shape.slots,
              "pairs": TOKENS * TOP_K, "expert_slices": [list(p.shape[1:]) for p in experts.parameters()]}
    pathlib.Path(OUT).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
