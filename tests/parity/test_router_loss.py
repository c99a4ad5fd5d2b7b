"""The router load-balancing loss the torch backend trains on (portable_fsdp/backends/hf_torch/loss.py): each rank's share, with
the choices per expert summed over the ranks, adds up to transformers' own loss over the whole batch — value and
gradient — where the loss of each rank's rows, averaged, does not. Two ranks simulated in one process."""
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from portable_fsdp.backends.hf_torch.loss import load_balancing_share

EXPERTS, TOP_K, LAYERS, ROWS = 4, 2, 2, 24


def router_logits(seed: int) -> list:
    """One [ROWS, EXPERTS] logits tensor per layer, skewed so that the halves of the batch route differently."""
    generator = torch.Generator().manual_seed(seed)
    skew = torch.linspace(-2, 2, ROWS)[:, None] * torch.arange(EXPERTS)
    return [(torch.randn(ROWS, EXPERTS, generator=generator) + skew).requires_grad_() for _ in range(LAYERS)]


def halves(logits: list) -> list:
    """Rank r's rows of every layer."""
    return [tuple(layer[r * ROWS // 2:(r + 1) * ROWS // 2] for layer in logits) for r in range(2)]


def gradients(loss, logits: list) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, logits)])


def test_the_shares_of_two_ranks_are_the_loss_of_the_whole_batch():
    logits = router_logits(0)
    whole = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    ranks = halves(logits)
    counted = []  # each rank's choices per expert and rows, as it hands them to the all-reduce
    for rows in ranks:
        load_balancing_share(rows, EXPERTS, TOP_K, lambda t: counted.append(t.clone()) or t)
    summed = counted[0] + counted[1]  # what the all-reduce returns on both ranks
    shares = [load_balancing_share(rows, EXPERTS, TOP_K, lambda t: summed.clone()) for rows in ranks]
    assert torch.allclose(shares[0] + shares[1], whole, rtol=1e-6)
    assert torch.allclose(gradients(shares[0] + shares[1], logits), gradients(whole, logits), rtol=1e-5, atol=1e-8)
    per_rank = sum(load_balancing_loss_func(rows, EXPERTS, TOP_K) for rows in ranks) / 2
    assert abs(per_rank - whole) > 1e-3 * whole  # what averaging the ranks' own losses would train on
