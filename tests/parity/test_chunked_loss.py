"""The torch loss a chunk of tokens at a time (portable_fsdp/backends/hf_torch/chunked_loss.py), inside the model's call: the
same loss and gradients as the cross-entropy of the whole micro-batch's logits — tied or not, with ignored
tokens, a last chunk shorter than the others, a biased projection split over rows and sequence parts as SPMD
splits them, a MoE router loss added —; predictions still get logits; a model that changes its logits after the
projection is left unchunked or stopped with the fix; Liger's fused kernel is taken on CUDA only, when
installed. Training runs with small chunks on gloo ranks and torch_xla: the matrix's loss_chunks variants."""
import copy

import pytest
import torch
import torch.nn.functional as F

from portable_fsdp.backends.hf_torch import chunked_loss
from portable_fsdp.backends.hf_torch.loss import RouterLoss, token_loss_sum
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.errors import UserError
from portable_fsdp.training.loss_chunks import Chunking

FP32_RTOL = 1e-6
GRAD_RTOL = 1e-5  # measured: 3e-7 (the weight gradient summed over chunks in another order)
VOCAB = 300


def tiny(architecture: str = "llama", **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **overrides)
    return AutoModelForCausalLM.from_config(config)


def batch(rows: int = 3, seq: int = 20):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    labels[0, :5] = IGNORE_INDEX
    return input_ids, labels


def loss_and_gradients(model, input_ids, labels, router=None) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, input_ids, labels, None, router)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def worst_gradient(grads: dict, expected: dict) -> float:
    assert set(grads) == set(expected)
    return max(float((g - expected[n]).norm() / expected[n].norm()) for n, g in grads.items())


def installed_copy(model, tokens: int):
    chunked = copy.deepcopy(model)
    assert chunked_loss.install(chunked, Chunking(tokens), "cpu")
    return chunked


@pytest.mark.parametrize("tokens", [1, 7, 10**6], ids=["one token", "uneven chunks", "one chunk"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_loss_and_every_gradient_equal_the_whole_batch(tie, tokens):
    model = tiny(tie_word_embeddings=tie)
    input_ids, labels = batch()
    expected, expected_grads = loss_and_gradients(model, input_ids, labels)
    chunked = installed_copy(model, tokens)
    value, grads = loss_and_gradients(chunked, input_ids, labels)
    assert abs(value - expected) <= FP32_RTOL * expected
    assert worst_gradient(grads, expected_grads) <= GRAD_RTOL
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == tie


def test_a_biased_projection_split_over_rows_and_sequence_parts():
    """As torch_xla's SPMD program calls it: 2 sequence parts, rows over 2 devices, chunks of 3 positions."""
    generator = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(16, 40, bias=True)
    hidden = torch.randn(4, 12, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 40, (4, 12), generator=generator)
    labels[1, 3:9] = IGNORE_INDEX
    whole = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    expected = torch.autograd.grad(whole, [hidden, head.weight, head.bias])
    sums = chunked_loss.chunked_loss_sums(hidden, head.weight, head.bias, labels, Chunking(6, 2, 2))
    assert sums.shape == (4, 2)  # [rows, sequence parts]: what the SPMD wrapper annotates like logits
    assert torch.allclose(sums.sum(), whole, rtol=FP32_RTOL)
    for got, want in zip(torch.autograd.grad(sums.sum(), [hidden, head.weight, head.bias]), expected):
        assert float((got - want).norm() / want.norm()) <= GRAD_RTOL


def test_eval_is_chunked_and_predictions_still_get_logits():
    model = tiny()
    input_ids, labels = batch()
    chunked = installed_copy(model, 7)
    with torch.no_grad():
        expected = token_loss_sum(model, input_ids, labels, None).item()
        assert abs(token_loss_sum(chunked, input_ids, labels, None).item() - expected) <= FP32_RTOL * expected
        logits = chunked(input_ids=input_ids, use_cache=False).logits  # no labels: a prediction
        assert torch.equal(logits, model(input_ids=input_ids, use_cache=False).logits)


def test_the_router_loss_stays_added():
    model = tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                 router_aux_loss_coef=0.5)
    input_ids, labels = batch()
    router = RouterLoss(weight=float((labels != IGNORE_INDEX).sum()), all_reduce=lambda t: t)
    expected, expected_grads = loss_and_gradients(model, input_ids, labels, router)
    without_router, _ = loss_and_gradients(model, input_ids, labels)
    assert expected - without_router > 1.0  # the router's share is in the number compared
    value, grads = loss_and_gradients(installed_copy(model, 7), input_ids, labels, router)
    assert abs(value - expected) <= FP32_RTOL * expected
    assert worst_gradient(grads, expected_grads) <= GRAD_RTOL


def test_a_model_that_changes_its_logits_is_left_unchunked_or_stopped():
    softcapped = tiny("gemma2", head_dim=8, final_logit_softcapping=30.0)
    assert not chunked_loss.install(softcapped, Chunking(7), "cpu")
    assert chunked_loss.installed(softcapped) is None

    class ScaledLlama(type(tiny())):  # a change the config does not announce
        def forward(self, *args, **kwargs):
            outputs = super().forward(*args, **kwargs)
            outputs.logits = outputs.logits * 0.5
            return outputs

    scaled = ScaledLlama(tiny().config)
    assert chunked_loss.install(scaled, Chunking(7), "cpu")
    with pytest.raises(UserError, match="ScaledLlama changes its logits after its output projection.*"
                                        "set train.loss_chunk_tokens=0"):
        token_loss_sum(scaled, *batch(), None)


def test_zero_tokens_installs_nothing():
    model = tiny()
    assert not chunked_loss.install(model, Chunking(0), "cpu")
    assert chunked_loss.installed(model) is None


@pytest.mark.parametrize("device, liger, chunking, fused", [
    ("cuda", True, Chunking(1024), True),
    ("cuda", False, Chunking(1024), False),
    ("cpu", True, Chunking(1024), False),
    ("cuda", True, Chunking(1024, sequence_parts=2), False),  # a global program splits chunks over devices
])
def test_liger_fused_kernel_is_taken_on_cuda_when_installed(monkeypatch, device, liger, chunking, fused):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if liger else None) if name == "liger_kernel" else real(name, *a))
    assert chunked_loss.fused_kernel_available(device) == (liger and device == "cuda")
    model = tiny()
    assert chunked_loss.install(model, chunking, device)
    assert chunked_loss.installed(model).fused == fused


@pytest.mark.parametrize("precision", ["autocast", "parameters"])
def test_bf16_is_within_a_rounding_step(precision):
    """bf16 by autocast (a world of one rank) or in the parameters (FSDP2's mixed precision): the chunked loss
    within a bf16 step of the unchunked one (measured: equal losses, gradients 2.3e-3 and 3.9e-3; bf16 against
    fp32 differs by 8e-3 and 1.3e-2)."""
    model = tiny() if precision == "autocast" else tiny().to(torch.bfloat16)
    input_ids, labels = batch()
    chunked = installed_copy(model, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        expected, expected_grads = loss_and_gradients(model, input_ids, labels)
        value, grads = loss_and_gradients(chunked, input_ids, labels)
    assert abs(value - expected) <= 2.0**-8 * expected
    assert worst_gradient(grads, expected_grads) <= 2.0**-7
