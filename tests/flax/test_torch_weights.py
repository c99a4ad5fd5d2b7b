"""Weight conversion between transformers and the Flax Llama loses no bit, directly and through a FULL
checkpoint directory."""
import numpy as np
import pytest
import torch
from safetensors import safe_open

from portable_fsdp.backends.flax import architecture, torch_weights, model as model_lib
from tests.flax.test_model import hf_llama


def flax_names(hf_model):
    arch = architecture.from_hf_config(hf_model.config)
    return arch, list(model_lib.define(arch).variables)


def assert_bit_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        as_bytes = [t.contiguous().flatten().view(torch.uint8) for t in (a[name], b[name])]
        assert torch.equal(*as_bytes), name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_to_flax_to_torch_is_bit_exact(tied, dtype):
    hf_model = hf_llama(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied).to(dtype)
    arch, names = flax_names(hf_model)
    params = torch_weights.from_torch(hf_model.state_dict(), names, arch)
    assert params["model.layers.0.self_attn.q_proj.kernel"].shape == (64, 64)  # [in, out]
    assert ("lm_head.kernel" in params) != tied
    assert_bit_equal(torch_weights.to_torch(params, arch), hf_model.state_dict())


@pytest.mark.parametrize("tied", [False, True])
def test_full_checkpoint_directory_round_trip(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    hf_model = hf_llama(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    arch, names = flax_names(hf_model)
    hf_model.save_pretrained(tmp_path / "from_torch")
    params = torch_weights.read_safetensors_dir(tmp_path / "from_torch", names, arch)
    direct = torch_weights.from_torch(hf_model.state_dict(), names, arch)
    assert all(np.array_equal(params[n], direct[n]) for n in names)

    (tmp_path / "from_flax").mkdir()
    torch_weights.write_safetensors(params, arch, tmp_path / "from_flax" / "model.safetensors")
    hf_model.config.save_pretrained(tmp_path / "from_flax")
    with safe_open(tmp_path / "from_flax" / "model.safetensors", "pt") as ours, \
            safe_open(tmp_path / "from_torch" / "model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys()) and ours.metadata() == theirs.metadata()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "from_flax", local_files_only=True, dtype=torch.float32)
    assert_bit_equal(reloaded.state_dict(), hf_model.state_dict())


def test_init_from_a_local_directory_starts_from_its_weights(tmp_path):
    """model.init_from: the flax run starts from the directory's weights, converted (llama3 RoPE, tied)."""
    import jax

    from tests.flax.conftest import init_state, make_config
    from tests.flax.test_model import LLAMA3_ROPE

    hf_model = hf_llama(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                        rope_parameters=LLAMA3_ROPE, vocab_size=300)
    hf_model.save_pretrained(tmp_path)
    state = init_state(make_config({"model.init_from": str(tmp_path)}), len(jax.devices()))
    arch, names = flax_names(hf_model)
    assert state.ctx.model_def.arch == arch
    expected = torch_weights.from_torch(hf_model.state_dict(), names, arch)
    assert all(np.array_equal(np.asarray(state.params[n]), expected[n]) for n in names)
