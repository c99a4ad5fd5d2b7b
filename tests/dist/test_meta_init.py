"""Every rank builds the model on the meta device and fills only its own shards of the seeded init
(hf_torch.model.create_on_meta, torch.model.materialize_shards): no rank builds the whole model, the gathered FULL
state dict and the buffers are the single-process init's bit for bit (FSDP2, tensor and expert parallelism,
tied embeddings that stay one parameter, activation checkpointing, CPU offload; weights read from a
directory's safetensors files), and a rank's memory after
start-up shrinks with the world."""
import json
import os

import pytest

from tests.dist.launch import torchrun

HERE = os.path.dirname(__file__)
DEFAULT_CASES = ["fsdp", "tied", "tied_tp2", "moe_config_ep2", "pretrained"]
SLOW_CASES = ["tied_checkpointed", "tp2", "cpu_offload", "moe_config", "pretrained_tp2"]


def run_check(tmp_path, world: int, mode: str, names: list) -> dict:
    out = tmp_path / f"{mode}-{world}.json"
    torchrun(world, os.path.join(HERE, "meta_init_check.py"), str(out), mode, *names)
    return json.loads(out.read_text())


def moe_config(directory) -> str:
    """config.json of a tiny Qwen3-MoE (4 experts of which 2 per token)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128)
    config.save_pretrained(directory)
    return str(directory / "config.json")


def pretrained(directory) -> str:
    """A tied model of the test recipe's sizes saved by save_pretrained, weights in bf16 (cast to fp32 on
    loading), drawn from another seed than the recipe's."""
    import torch

    from portable_fsdp.backends.hf_torch.model import hf_config
    from tests.parity.matrix import make_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = make_config({"model.tie_word_embeddings": "true"})
    AutoModelForCausalLM.from_config(hf_config(config.model), dtype=torch.bfloat16).save_pretrained(directory)
    return str(directory)


def check_bits(results: dict, names: list) -> None:
    for name in names:
        result = results[name]
        assert not result["built_whole"], name
        assert result["compared"] > 0 and result["missing"] == [] and result["differing"] == [], (name, result)
        assert result["tied"] == result["reference_tied"] == ("tied" in name or "pretrained" in name), name


@pytest.mark.parametrize("names", [DEFAULT_CASES, pytest.param(SLOW_CASES, marks=pytest.mark.slow)])
def test_sharded_init_is_the_single_process_init(tmp_path, monkeypatch, names):
    monkeypatch.setenv("MOE_CONFIG", moe_config(tmp_path))  # the ranks inherit them
    monkeypatch.setenv("PRETRAINED", pretrained(tmp_path / "pretrained"))
    results = run_check(tmp_path, 2, "bits", names)
    check_bits(results, names)


@pytest.mark.slow
def test_resident_memory_after_init_shrinks_with_the_world(tmp_path):
    """~110M parameters (440 MB in fp32): what start-up adds to a rank's resident set (the model's part, over
    the libraries' and the process group's) at 4 ranks is at most 0.35 of one rank's, which holds it whole."""
    one = run_check(tmp_path, 1, "memory", ["llama_100m"])["llama_100m"]
    four = run_check(tmp_path, 4, "memory", ["llama_100m"])["llama_100m"]
    assert one["params"] > 100e6
    model_part = [r - b for r, b in zip(four["resident_mb"], four["baseline_mb"])]
    whole = one["resident_mb"][0] - one["baseline_mb"][0]
    assert whole > 0.9 * one["params"] * 4 / 2**20  # one rank holds the whole model
    assert max(model_part) <= 0.35 * whole, (model_part, whole)


@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe", "gpt2", "gemma"])
def test_replayed_init_is_from_config_bit_for_bit(architecture):
    """In one process: the recording replayed from the seed gives every parameter of `from_config`'s init."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from portable_fsdp.backends.hf_torch import deferred_init

    config = AutoConfig.for_model(architecture, vocab_size=96, hidden_size=32, intermediate_size=64, n_embd=32,
                                  num_hidden_layers=2, n_layer=2, num_attention_heads=4, n_head=4,
                                  num_key_value_heads=2, num_experts=4, moe_intermediate_size=16, head_dim=8)

    def build():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    torch.manual_seed(5)
    expected = dict(build().named_parameters(remove_duplicate=False))
    after_reference = torch.rand(3)
    model, recording = deferred_init.build_on_meta(build)
    assert all(p.is_meta for p in model.parameters())
    got = {}
    deferred_init.replay(recording, 5, lambda names, full: got.update(dict.fromkeys(names, full)))
    assert sorted(got) == sorted(expected)
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []
    assert torch.equal(torch.rand(3), after_reference)  # the generator is left where the init leaves it


def test_an_init_that_cannot_be_replayed_is_built_whole():
    """A parameter initialised from another tensor is refused (create_on_meta then builds the model whole)."""
    import torch

    from portable_fsdp.backends.hf_torch import deferred_init

    def build():
        model = torch.nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(torch.eye(4) * 2)
        return model

    with pytest.raises(deferred_init.Unsupported):
        deferred_init.build_on_meta(build)
