"""Under torchrun: portable CP attention vs unsharded SDPA on every rank, forward and backward.
Writes rank 0's worst absolute differences per case to JSON.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/dist/cp_attention_check.py OUT.json
"""
import itertools
import json
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from portable_fsdp.backends.torch.context_parallel import attention
from portable_fsdp.backends.torch.context_parallel.attention import ShardLayout, allgather_attention, ring_attention
from portable_fsdp.training.sequence_split import shard_indices


DEFAULT_CHUNK = attention.CHUNK_ELEMENTS


def reference(q, k, v, segments, scale):
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                                          attn_mask=mask, scale=scale)


def check(method: str, load_balance: bool, documents: bool, group) -> dict:
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, seq, d = 2, 4, 2, 8 * cp_size, 16
    q = torch.randn(b, h, seq, d, generator=gen, requires_grad=True)
    k = torch.randn(b, hkv, seq, d, generator=gen, requires_grad=True)
    v = torch.randn(b, hkv, seq, d, generator=gen, requires_grad=True)
    dout = torch.randn(b, h, seq, d, generator=gen)
    segments = None
    if documents:  # documents of uneven lengths that straddle shard boundaries
        cuts = torch.zeros(b, seq, dtype=torch.long)
        cuts[0, [3, 11]] = 1
        cuts[1, [seq // 2 + 1]] = 1
        segments = cuts.cumsum(1)
    scale = d ** -0.5
    expected = reference(q, k, v, segments, scale)
    expected.backward(dout)
    index = [torch.from_numpy(shard_indices(seq, cp_size, r, load_balance)) for r in range(cp_size)]
    mine = index[cp_rank]
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    layout = ShardLayout(group, cp_rank, cp_size, method, tuple(index),
                         None if segments is None else segments[:, mine])
    attend = allgather_attention if method == "allgather" else ring_attention
    out = attend(*local, layout, scale)
    out.backward(dout[:, :, mine])
    diffs = {"out": (out - expected[:, :, mine]).abs().max().item()}
    for name, full, shard in zip("qkv", (q, k, v), local):
        diffs[f"d{name}"] = (shard.grad - full.grad[:, :, mine]).abs().max().item()
    worst = torch.tensor([max(diffs.values())], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {**diffs, "worst_all_ranks": worst.item()}


def main():
    dist.init_process_group("gloo")
    results = {}
    for method, balance, documents, chunked in itertools.product(("allgather", "alltoall"), (True, False),
                                                                 (False, True), (False, True)):
        # chunked: a tiny chunk budget, so query rows are processed one or two at a time
        attention.CHUNK_ELEMENTS = 64 if chunked else DEFAULT_CHUNK
        name = (f"{method}-{'balanced' if balance else 'contiguous'}-{'documents' if documents else 'causal'}"
                f"{'-chunked' if chunked else ''}")
        results[name] = check(method, balance, documents, dist.group.WORLD)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
