"""The xla backend's MoE experts: the block kernel (portable_fsdp/backends/xla/expert_blocks.py) equals transformers'
experts in plain torch — outputs and gradients, with experts that no token chose and experts that every token chose
—, computes the routed pairs plus a bounded padding, and under expert parallelism
(portable_fsdp/backends/xla/expert_dispatch.py) runs on PJRT CPU devices exchanging token blocks, never the expert
weights (the collectives of the partitioned HLO)."""
import json
import math
import re

import pytest
import torch
from transformers.integrations.moe import batched_mm_experts_forward

from portable_fsdp import routed_blocks
from portable_fsdp.backends.xla import expert_blocks
from tests.xla.helpers import run_script, tiny_experts

TOLERANCE = 1e-5
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 16, 24, 4, 2


def routings(tokens: int) -> dict:
    """name -> top-k expert ids [tokens, TOP_K]: balanced, uneven (expert 0 never chosen, expert 1 always), and all
    tokens on the same two experts."""
    generator = torch.Generator().manual_seed(1)
    balanced = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    second = torch.randint(2, EXPERTS, (tokens,), generator=generator)
    return {"balanced": balanced, "uneven": torch.stack([torch.ones_like(second), second], dim=1),
            "two_experts": torch.tensor([[3, 2]] * tokens)}


def output_and_grads(layer, forward, hidden, top_k_index, top_k_weights) -> list:
    hidden, top_k_weights = hidden.clone().requires_grad_(), top_k_weights.clone().requires_grad_()
    out = forward(layer, hidden, top_k_index, top_k_weights)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * cotangent).sum(), [hidden, top_k_weights, *layer.parameters()])
    return [out, *grads]


@pytest.mark.parametrize("tokens", [1, 37, 256])
@pytest.mark.parametrize("routing", ["balanced", "uneven", "two_experts"])
def test_blocks_equal_transformers_experts(tokens, routing):
    layer = tiny_experts(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    top_k_weights = torch.rand(tokens, TOP_K, generator=torch.Generator().manual_seed(4))
    top_k_index = routings(tokens)[routing]
    ours = output_and_grads(layer, expert_blocks.experts_forward, hidden, top_k_index, top_k_weights)
    reference = output_and_grads(layer, batched_mm_experts_forward, hidden, top_k_index, top_k_weights)
    for a, b in zip(ours, reference):  # sums of up to 256 tokens' terms, in another order
        assert (a - b).abs().max() <= TOLERANCE * max(1.0, b.abs().max())


@pytest.mark.parametrize("tokens,top_k,experts,groups", [(512, 2, 4, 1), (512, 2, 4, 2), (16384, 8, 128, 1),
                                                         (16384, 8, 128, 8), (7, 2, 8, 1), (7, 2, 8, 4)])
def test_blocks_hold_every_routing(tokens, top_k, experts, groups):
    """The static bound: whatever the routing, every group's blocks hold its pairs (all tokens on one group's
    experts, as unevenly as they can be split)."""
    shape = expert_blocks.Shape(tokens, top_k, experts, groups)
    crowded = torch.arange(top_k).repeat(tokens, 1) % shape.experts_per_group  # group 0, first experts
    for top_k_index in (crowded, routings_of(tokens, top_k, experts)):
        counts = torch.bincount(top_k_index.reshape(-1), minlength=experts)
        blocks = ((counts + shape.rows - 1) // shape.rows).view(groups, -1).sum(1)
        assert int(blocks.max()) <= shape.blocks_per_group


def routings_of(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])


# Matmul rows the kernel runs (its shapes) per routed pair: each row of a block costs the same FLOPs as a pair.
# One group: at most 1 + experts x (rows - 1) / pairs, rows chosen to keep that under 1 + 1/PADDING_SHARE; groups:
# each group sized for all the pairs a token can send it.
@pytest.mark.parametrize("tokens,top_k,experts,groups,executed", [
    (512, 2, 4, 1, 1.1875),  # the tiny Mixtral of the parity tests: 8 rows x 64 positions
    (256, 2, 4, 2, 2.125),   # ... with ep 2: each of 2 devices routes its 256 tokens
    (16384, 8, 128, 1, 1.124),  # Qwen3-30B-A3B's routing, 16k tokens
    (2048, 8, 128, 8, 8.234)])  # ... with ep 8: each of 8 devices routes its 2k tokens
def test_executed_flops_against_active(tokens, top_k, experts, groups, executed):
    shape = expert_blocks.Shape(tokens, top_k, experts, groups)
    assert shape.slots / (tokens * top_k) == pytest.approx(executed, abs=1e-3)
    if groups == 1:
        assert shape.slots <= tokens * top_k * (1 + 1 / routed_blocks.PADDING_SHARE)


# devices, ep_size, tp_size: no ep on 2 devices, ep 2 alone, fsdp 2 x ep 2, fsdp 2 x tp 2 with ep 4.
MESHES = [(2, 1, 1), (2, 2, 1), (4, 2, 1), (4, 4, 2)]


@pytest.fixture(scope="module")
def on_devices(tmp_path_factory):
    cache = {}

    def result(devices: int, ep: int, tp: int) -> dict:
        if (devices, ep, tp) not in cache:
            out = tmp_path_factory.mktemp("moe") / "moe.json"
            run_script("moe_check.py", [out, devices, ep, tp])
            cache[devices, ep, tp] = json.loads(out.read_text())
        return cache[devices, ep, tp]

    return result


@pytest.mark.parametrize("devices,ep,tp", MESHES)
def test_xla_experts_equal_transformers_experts(on_devices, devices, ep, tp):
    differences = on_devices(devices, ep, tp)["differences"]
    assert max(differences.values()) <= TOLERANCE, differences


@pytest.mark.parametrize("devices,ep,tp", [m for m in MESHES if m[1] > 1])
def test_expert_parallelism_moves_tokens_not_expert_weights(on_devices, devices, ep, tp):
    """The partitioned step exchanges token blocks (all-to-all) and no device gathers more experts than its own
    group's (FSDP gathers those over fsdp): no all-gather of more than experts / ep tensors shaped like an expert's
    [2I, H] or [H, I] (or transposed)."""
    result = on_devices(devices, ep, tp)
    collectives = result["collectives"]
    weight_slices = {tuple(s) for s in result["expert_slices"]} | {tuple(s[::-1]) for s in result["expert_slices"]}
    gathered = [tuple(map(int, re.findall(r"\d+", shape.split("[", 1)[1]))) for shape in collectives["all-gather"]]
    across_groups = [shape for shape in gathered
                     if shape[-2:] in weight_slices and math.prod(shape[:-2]) > result["experts"] // ep]
    assert not across_groups, collectives["all-gather"]
    assert collectives["all-to-all"] > 0


@pytest.mark.parametrize("devices,ep,tp", MESHES)
def test_executed_rows_on_devices(on_devices, devices, ep, tp):
    """The matmul FLOPs the devices execute (their compiled programs' dots, summed over the devices) are those of the
    blocks' rows (expert_blocks.Shape): without ep the padding bound; with ep up to ep x the routed pairs (each
    group sized for all of them)."""
    result = on_devices(devices, ep, tp)
    assert result["executed_rows"] == result["slots"]
    ratio = result["executed_rows"] / result["pairs"]
    assert 1 <= ratio <= ep * (1 + 1 / routed_blocks.PADDING_SHARE)


def test_tokens_that_do_not_split_over_the_devices_are_one_line_naming_the_fix():
    import types

    from portable_fsdp.backends.xla.expert_dispatch import dispatching_forward
    from portable_fsdp.errors import UserError

    from portable_fsdp.placement import MESH_AXES

    sizes = dict.fromkeys(MESH_AXES, 1) | {MESH_AXES[1]: 2, MESH_AXES[2]: 2}  # fsdp 2 x ep 2
    mesh = types.SimpleNamespace(shape=lambda: sizes)
    with pytest.raises(UserError) as error:
        dispatching_forward(None, torch.zeros(6, 8), torch.zeros(6, 2, dtype=torch.long), torch.zeros(6, 2), mesh=mesh)
    assert error.value.field == "plan.ep_size" and "\n" not in str(error.value)
    assert "6 tokens" in str(error.value) and "a multiple of 4" in str(error.value)
