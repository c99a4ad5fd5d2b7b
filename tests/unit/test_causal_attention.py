"""The cpu lowering's causal attention in query blocks (portable_fsdp/backends/torch/causal_attention.py): the same
attention as sdpa's, forward and backward, on the paths it takes; sdpa's own call on every other."""
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from portable_fsdp.backends.torch import causal_attention
from portable_fsdp.backends.torch.causal_attention import (KERNEL_SKIPS_FROM, NAME, SHORT_BLOCK,
                                                           apply_blocked_causal_attention, blocked_causal_attention,
                                                           query_block)
from portable_fsdp.backends.torch.parallelize import parallelize
from portable_fsdp.plan import ShardingPlan


def _attention_module(heads: int, kv_heads: int):
    return types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads, training=True)


def _qkv(length: int, heads: int, kv_heads: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, length, 16), (2, kv_heads, length, 16), (2, kv_heads, length, 16)]
    return [torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("length, block", [(64, None), (65, 64), (256, 64), (512, 64), (513, 128), (1024, 128),
                                           (2047, 128), (2048, None), (8192, None)])
def test_the_block_follows_the_length(length, block):
    assert query_block(length) == block


@pytest.mark.parametrize("length", [SHORT_BLOCK + 1, 2 * SHORT_BLOCK, 300, 600])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_blocked_attention_is_sdpa_causal_attention_forward_and_backward(length, heads, kv_heads):
    module = _attention_module(heads, kv_heads)
    ours, reference = _qkv(length, heads, kv_heads), _qkv(length, heads, kv_heads)
    out, weights = blocked_causal_attention(module, *ours, None, scaling=0.3)
    expected, _ = sdpa_attention_forward(module, *reference, None, scaling=0.3)
    assert weights is None and out.shape == (2, length, heads, 16)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-5)


def test_the_blocks_read_only_the_keys_up_to_their_last_position(monkeypatch):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def counting(query, key, value, **kwargs):
        seen.append((query.shape[2], key.shape[2], kwargs.get("is_causal", False), kwargs.get("attn_mask") is not None))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(causal_attention.F, "scaled_dot_product_attention", counting)
    blocked_causal_attention(_attention_module(4, 2), *_qkv(300, 4, 2), None)
    assert seen == [(64, 64, True, False), (64, 128, False, True), (64, 192, False, True), (64, 256, False, True),
                    (44, 300, False, True)]
    # 64·(64 + 128 + 192 + 256) + 44·300 of 300·300 query-key pairs
    assert sum(q * k for q, k, _, _ in seen) / 300**2 == pytest.approx(0.602, abs=1e-3)


@pytest.mark.parametrize("case", ["mask", "dropout", "short", "long", "cache", "not causal"])
def test_anything_else_is_transformers_sdpa_call_unchanged(case):
    module = _attention_module(4, 2)
    length = {"short": SHORT_BLOCK, "long": KERNEL_SKIPS_FROM}.get(case, 2 * SHORT_BLOCK)
    query, key, value = _qkv(length, 4, 2)
    kwargs = {"dropout": 0.0}
    mask = None
    if case == "mask":
        mask = torch.ones(2, 1, length, length, dtype=torch.bool).tril()
        mask[0, :, :, :3] = False  # padding on the left of the first row
        mask[0, :, :3, 0] = True  # ... which still sees something
    if case == "dropout":
        kwargs["dropout"] = 0.5
    if case == "cache":
        query = query[:, :, -1:]
    if case == "not causal":
        module.is_causal = False
    torch.manual_seed(0)
    out, _ = blocked_causal_attention(module, query, key, value, mask, **kwargs)
    torch.manual_seed(0)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    assert torch.equal(out, expected)


def _tiny_llama(implementation: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = implementation
    return LlamaForCausalLM(config)


def test_a_sdpa_model_trains_alike_through_the_blocked_attention(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    sdpa_model, blocked_model = _tiny_llama(), _tiny_llama()
    assert apply_blocked_causal_attention(blocked_model) and blocked_model.config._attn_implementation == NAME
    ids = torch.randint(0, 64, (2, 257), generator=torch.Generator().manual_seed(1))
    labels = ids[:, 1:].contiguous()
    losses, calls_per_model = [], []
    for model in (sdpa_model, blocked_model):
        calls.clear()
        loss = model(input_ids=ids[:, :-1], labels=labels, shift_labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss)
        calls_per_model.append(len(calls))
    # 2 layers: one sdpa call each, or 4 blocks of 64 (transformers' mask function gave no mask)
    assert calls_per_model == [2, 8]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (name, p), q in zip(sdpa_model.named_parameters(), blocked_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_only_sdpa_models_are_given_it():
    eager = _tiny_llama("eager")
    assert not apply_blocked_causal_attention(eager) and eager.config._attn_implementation == "eager"
    assert not apply_blocked_causal_attention(torch.nn.Linear(2, 2))  # a user's module: no transformers config


@pytest.mark.parametrize("device_type, with_cp, applied", [("cpu", False, True), ("cuda", False, False),
                                                           ("cpu", True, False)])
def test_parallelize_gives_it_to_cpu_runs_without_a_sequence_split(monkeypatch, device_type, with_cp, applied):
    # one rank: the plain module, moved to the device (a cuda one injected: the move is what it would do there)
    import portable_fsdp.backends.torch.parallelize as lowering
    monkeypatch.setattr(lowering, "apply_context_parallel", lambda model, cp: None)
    model = _tiny_llama()
    monkeypatch.setattr(model, "to", lambda device: model)
    meshes = types.SimpleNamespace(world=types.SimpleNamespace(size=lambda: 1), tp=None, ep=None)
    parallelize(model, ShardingPlan(), meshes, object() if with_cp else None, None, ("LlamaDecoderLayer",),
                device_type, {})
    assert (model.config._attn_implementation == NAME) is applied
