"""Context parallelism for the torch lowering: each rank of a cp group holds a slice of every sequence.

`portable` (any device): our own attention, plugged into transformers through its attention interface —
allgather (gather K/V over the group) or alltoall (pass K/V blocks round the ring, merging with an
fp32 online softmax). `torch` (CUDA): torch's experimental `context_parallel` over SDPA.
"""
from portable_fsdp.backends.torch.context_parallel.apply import (CPGroup, apply_context_parallel, sequence_shard,
                                                                 slice_batch)

__all__ = ["CPGroup", "apply_context_parallel", "sequence_shard", "slice_batch"]
