"""MFU of a mixture-of-experts model counts what a token runs through: the top-k of the routed experts, every
other weight, never the input embedding table. Each count is checked against a hand computation from the
config's sizes (described on the meta device: no weight is allocated), at smoke size and at Qwen3-30B-A3B's."""
import pytest

from portable_fsdp.training import metrics
from portable_fsdp.backends.hf_torch.model import describe_model
from portable_fsdp.config.schema import load_recipe
from tests.conftest import ROOT
from tests.parity import families

RECIPE = str(ROOT / "portable_fsdp" / "configs" / "qwen3_30b_a3b.py")


def qwen3_moe_active(vocab, hidden, layers, heads, kv_heads, head_dim, moe_intermediate, experts, top_k) -> int:
    """Qwen3-MoE by hand: attention (q, k, v, o and the per-head q/k norms), the router, top_k of the routed
    experts (gate, up and down), two norms per layer; the final norm and the untied lm_head."""
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden + 2 * head_dim
    router = hidden * experts
    active_experts = top_k * 3 * hidden * moe_intermediate
    return layers * (attention + router + active_experts + 2 * hidden) + hidden + vocab * hidden


def test_qwen3_moe_smoke_counts_the_active_experts():
    config = load_recipe(f"{RECIPE}:smoke")
    info = describe_model(config)
    # smoke: vocab 384, hidden 64, 2 layers, 4 heads of 16 (2 kv), 4 experts of 32, 2 per token
    assert (info.num_experts, info.experts_per_token) == (4, 2)
    assert info.n_routed_expert_params == 2 * 4 * 3 * 64 * 32
    expected = qwen3_moe_active(384, 64, 2, 4, 2, 16, 32, 4, 2)
    assert info.n_active_params == expected
    assert info.n_params - info.n_embedding_params - info.n_active_params == 2 * 2 * 3 * 64 * 32  # 2 idle experts
    assert metrics.flops_per_token(info, 64) == 6 * expected + 12 * 2 * 64 * 64


def test_qwen3_30b_a3b_is_counted_at_its_3b_active_parameters():
    info = describe_model(load_recipe(f"{RECIPE}:8xh100"))
    expected = qwen3_moe_active(151936, 2048, 48, 32, 4, 128, 768, 128, 8)
    assert info.n_active_params == expected
    # Qwen's own figure, 3.3B activated, counts the input embedding table too
    assert info.n_active_params + info.n_embedding_params == pytest.approx(3.3e9, rel=0.02)
    assert info.n_params / info.n_active_params > 9  # counting every expert was ~10x too high


def test_mixtral_counts_its_two_of_four_experts(tmp_path):
    directory = families.save_model("mixtral", tmp_path / "mixtral")
    config = load_recipe(f"{ROOT / 'portable_fsdp' / 'configs' / 'llama_tiny.py'}:test")
    config.model.init_from = str(directory)
    info = describe_model(config)
    # hidden 64, 2 layers, 4 heads of 16 (2 kv heads), 4 experts of 160, 2 per token, vocab 384, untied
    hidden, layers, vocab, kv, ffn = 64, 2, 384, 2 * 16, 160
    attention = 2 * hidden * hidden + 2 * hidden * kv
    per_layer = attention + hidden * 4 + 2 * 3 * hidden * ffn + 2 * hidden
    assert info.n_routed_expert_params == layers * 4 * 3 * hidden * ffn
    assert info.n_active_params == layers * per_layer + hidden + vocab * hidden


def test_a_dense_model_is_counted_whole():
    info = describe_model(load_recipe(f"{ROOT / 'portable_fsdp' / 'configs' / 'llama_tiny.py'}:test"))
    assert info.n_routed_expert_params == 0
    assert info.n_active_params == info.n_params - info.n_embedding_params


def test_a_step_executes_the_flops_mfu_counts():
    """One forward and backward of the Qwen3-MoE smoke model, counted by torch (executed_flops): its experts execute
    exactly 6 × the active routed experts' weights per token (only the rows routed to them), and the whole step
    what MFU assumes up to the norms' weights, which MFU counts as matrix weights (0.5% here)."""
    import torch

    from portable_fsdp.backends.hf_torch import experts
    from portable_fsdp.backends.hf_torch.model import create_model
    from portable_fsdp.backends.torch import executed_flops

    config = load_recipe(f"{RECIPE}:smoke")
    info = describe_model(config)
    model = create_model(config, 0, rank0_only=False)
    experts.set_implementation(model, experts.choose("cpu"))
    ids = torch.randint(0, config.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    executed = executed_flops.per_token(model, ids, ids)
    active_experts = info.n_routed_expert_params * info.experts_per_token / info.num_experts
    assert executed["experts"] == 6 * active_experts
    assert executed["model"] == pytest.approx(metrics.flops_per_token(info, 64), rel=0.01)
