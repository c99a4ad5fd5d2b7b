"""The flax backend builds the families that are a Llama with switches — Qwen2 (q/k/v biases), Mistral (a sliding
window, 32 tokens over 64-token sequences in the tiny model) and Mixtral (a mixture of experts) — and computes what
transformers does: logits (and Mixtral's load-balancing loss) on the same weights, and losses of a CLI run (JAX
host devices, under tensor, sequence and expert parallelism too) against the plain-torch reference. The families
it does not build are refused at start-up (tests/e2e/test_model_families.py)."""
import numpy as np
import pytest
import torch

from tests.flax.test_model import FP32_LOGIT_TOLERANCE, flax_logits, torch_logits
from tests.parity import families

WINDOWED = {"qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),  # layer 1 only
            "mistral": dict(sliding_window=16)}
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def hf_model(family: str, **settings):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, **settings)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases and norm scales, so a mix-up cannot hide behind zeros and ones
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def packed_batch():
    input_ids = np.random.default_rng(1).integers(0, 97, (3, 48))
    positions = np.broadcast_to(np.arange(48), input_ids.shape).copy()
    positions[1, 20:] = np.arange(28)  # a second packed document in row 1
    return input_ids, positions


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_logits_equal_transformers(family):
    model = hf_model(family, **WINDOWED[family])
    input_ids, positions = packed_batch()
    difference = np.abs(flax_logits(model, input_ids, positions) - torch_logits(model, input_ids, positions))
    assert difference.max() <= FP32_LOGIT_TOLERANCE


def test_mixtral_logits_and_load_balancing_loss_equal_transformers():
    """Converted from transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and back bit for
    bit; the same logits and the same router load-balancing loss (output_router_logits)."""
    import jax

    from portable_fsdp.backends.flax import architecture, torch_weights, model as model_lib

    model = hf_model("mixtral", **MOE, output_router_logits=True)
    arch = architecture.from_hf_config(model.config)
    assert (arch.num_experts, arch.experts_per_token, arch.router_aux_loss_coef) == (4, 2, 0.001)
    model_def = model_lib.define(arch)
    params = torch_weights.from_torch(model.state_dict(), model_def.variables, arch)
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2, 64, 96)  # [E, gate|up, in, out]
    back = torch_weights.to_torch(params, arch)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[n], t) for n, t in model.state_dict().items())

    input_ids, positions = packed_batch()
    logits, balance = jax.jit(model_def.forward)(params, input_ids, positions)
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(input_ids), position_ids=torch.from_numpy(positions),
                       use_cache=False)
    assert np.abs(np.asarray(logits) - theirs.logits.numpy()).max() <= FP32_LOGIT_TOLERANCE
    assert float(balance) == pytest.approx(theirs.aux_loss.item(), rel=1e-6)
    assert float(balance) > 1.0  # num_experts x Σ fraction x probability: 1 when perfectly balanced


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in ("qwen2", "mistral")])
def test_family_trains_like_plain_torch_on_flax(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("flax", model, tmp_path)


# family -> (devices, plan): tensor and Ulysses sequence parallelism on Qwen2 (q/k/v biases split with their
# columns), expert parallelism alone and inside fsdp (fsdp 4 = 2 x ep 2), and ep with tp on Mixtral — the ep
# ranks taken from fsdp × tp: ep = tp on fsdp 1 and 2, ep 4 = fsdp 2 × tp 2.
PARALLEL = {"qwen2_tp2": ("qwen2", 2, {"plan.tp_size": 2}), "qwen2_sp2": ("qwen2", 2, {"plan.sp_size": 2}),
            "mixtral_ep2": ("mixtral", 2, {"plan.ep_size": 2}), "mixtral_fsdp4_ep2": ("mixtral", 4, {"plan.ep_size": 2}),
            "mixtral_fsdp1_tp2_ep2": ("mixtral", 2, {"plan.ep_size": 2, "plan.tp_size": 2}),
            "mixtral_fsdp2_tp2_ep2": ("mixtral", 4, {"plan.ep_size": 2, "plan.tp_size": 2}),
            "mixtral_fsdp2_tp2_ep4": ("mixtral", 4, {"plan.ep_size": 4, "plan.tp_size": 2})}
FAST_PARALLEL = ("mixtral_fsdp1_tp2_ep2",)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_PARALLEL else pytest.mark.slow)
                                  for n in PARALLEL])
def test_family_trains_like_plain_torch_on_a_parallel_mesh(name, tmp_path, tmp_path_factory):
    family, devices, plan = PARALLEL[name]
    families.assert_trains_like_plain_torch("flax", families.saved(tmp_path_factory, family), tmp_path,
                                            nproc=devices, plan=plan)


@pytest.mark.slow
def test_the_load_balancing_loss_trains_over_the_global_batch(tmp_path):
    """Mixtral with output_router_logits (weight 0.05, so that it shapes the updates): on fsdp 4 = 2 x ep 2 the
    loss is transformers' over each step's whole batch — averaging it per device would change every step."""
    model = families.save_model("mixtral", tmp_path / "model", output_router_logits=True, router_aux_loss_coef=0.05)
    families.assert_trains_like_plain_torch("flax", model, tmp_path, nproc=4, plan={"plan.ep_size": 2})
