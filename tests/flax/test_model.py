"""The Flax Llama computes what transformers' LlamaForCausalLM computes, on the same weights."""
import numpy as np
import pytest
import torch

from portable_fsdp.backends.flax import architecture, torch_weights, model as model_lib, rope

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CONFIGS = {
    "grouped_query_attention": dict(num_attention_heads=4, num_key_value_heads=2),
    "tied_embeddings": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope_one_kv_head": dict(num_attention_heads=4, num_key_value_heads=1, rope_parameters=LLAMA3_ROPE),
    "linear_rope_with_biases": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
}
FP32_LOGIT_TOLERANCE = 1e-5


def hf_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                            "max_position_embeddings": 256, **overrides})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random biases and norm scales, so a mix-up of them cannot hide behind zeros and ones
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def flax_logits(hf_model, input_ids, positions):
    import jax

    arch = architecture.from_hf_config(hf_model.config)
    model_def = model_lib.define(arch)
    params = torch_weights.from_torch(hf_model.state_dict(), model_def.variables, arch)
    return np.asarray(jax.jit(model_def.apply)(params, input_ids, positions))


def torch_logits(hf_model, input_ids, positions):
    with torch.no_grad():
        return hf_model(input_ids=torch.from_numpy(input_ids), position_ids=torch.from_numpy(positions),
                        use_cache=False).logits.numpy()  # as training calls it (a cache disables document masks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers(name):
    hf_model = hf_llama(**CONFIGS[name])
    input_ids = np.random.default_rng(1).integers(0, 97, (3, 48))
    positions = np.broadcast_to(np.arange(48), input_ids.shape).copy()
    difference = np.abs(flax_logits(hf_model, input_ids, positions) - torch_logits(hf_model, input_ids, positions))
    assert difference.max() <= FP32_LOGIT_TOLERANCE


def test_packed_documents_are_masked_like_transformers():
    """Restarting position ids mark packed documents; both models keep them from attending to each other."""
    hf_model = hf_llama(**CONFIGS["grouped_query_attention"])
    input_ids = np.random.default_rng(2).integers(0, 97, (2, 40))
    positions = np.stack([np.r_[np.arange(15), np.arange(25)], np.r_[np.arange(30), np.arange(10)]])
    ours, theirs = flax_logits(hf_model, input_ids, positions), torch_logits(hf_model, input_ids, positions)
    assert np.abs(ours - theirs).max() <= FP32_LOGIT_TOLERANCE
    unmasked = torch_logits(hf_model, input_ids, np.broadcast_to(np.arange(40), (2, 40)).copy())
    assert np.abs(ours[0, 15:] - unmasked[0, 15:]).max() > 1e-3  # the mask mattered


@pytest.mark.parametrize("parameters", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3_ROPE,
                                        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}])
def test_rope_frequencies_equal_transformers(parameters):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=parameters)
    init = ROPE_INIT_FUNCTIONS.get(parameters["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, scaling = init(config)
    ours, our_scaling = rope.inverse_frequencies(config.rope_parameters, 16)
    # numpy's and torch's float32 pow may differ in the last bits (2 ulp seen for theta 500000)
    np.testing.assert_array_max_ulp(ours, expected.numpy(), maxulp=2)
    assert our_scaling == scaling


def test_unsupported_models_are_refused_by_name():
    from transformers import GemmaConfig, LlamaConfig

    from portable_fsdp.errors import UserError

    with pytest.raises(UserError, match="rope_type 'dynamic'"):
        dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
        architecture.from_hf_config(LlamaConfig(rope_parameters=dynamic))
    with pytest.raises(UserError, match="gemma is not implemented by --backend flax"):  # Mistral, Qwen2 are built
        architecture.from_hf_config(GemmaConfig())
