"""model.peft's fields checked once at start-up, each mistake one line naming the field and the fix; a resume
into other adapters or another random base refused; the names peft's files give the adapters."""
import pytest

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.config.schema import apply_override, base_config, load_recipe
from portable_fsdp.config.validate import resolve_plan
from tests.conftest import TEST_RECIPE
from tests.unit._helpers import user_error


def resolved(**overrides):
    config = load_recipe(TEST_RECIPE)
    for key, value in overrides.items():
        apply_override(config, key, value)
    resolve_plan(config, 2)
    return config


def test_command_line_sets_each_field():
    config = resolved(**{"model.peft.type": "lora", "model.peft.r": "16", "model.peft.alpha": "32",
                         "model.peft.dropout": "0.05", "model.peft.target_modules": "q_proj,v_proj"})
    assert config.model.peft.to_dict() == {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.05,
                                           "target_modules": ["q_proj", "v_proj"]}
    assert base_config().model.peft.type == ""  # no adapters unless asked


@pytest.mark.parametrize("overrides, field, phrase", [
    ({"model.peft.type": "prefix"}, "model.peft.type", "unknown value 'prefix'; choose lora, or leave it empty"),
    ({"model.peft.type": "lora", "model.peft.r": "0"}, "model.peft.r", "must be at least 1 (got 0)"),
    ({"model.peft.type": "lora", "model.peft.alpha": "-2"}, "model.peft.alpha", "must be positive (got -2)"),
    ({"model.peft.type": "lora", "model.peft.dropout": "1.0"}, "model.peft.dropout", "must be in [0, 1) (got 1.0)"),
])
def test_a_bad_field_is_one_line_naming_it(overrides, field, phrase):
    with user_error(field, phrase):
        resolved(**overrides)


def test_without_peft_installed_the_fix_is_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with user_error("model.peft.type", "pip install 'portable_fsdp[peft]'"):
        resolved(**{"model.peft.type": "lora"})


def test_resume_into_other_adapters_or_another_random_base_is_refused():
    saved = resolved(**{"model.peft.type": "lora"})
    manifest = {"config": saved.to_dict(), "base_weights": "random init of llama, seed 0"}
    checkpointing.check_compatible(manifest, saved, "cpu")
    with user_error("train.resume", "model.peft {"):
        checkpointing.check_compatible(manifest, resolved(**{"model.peft.type": "lora", "model.peft.r": "4"}), "cpu")
    with user_error("train.resume", "seed 0 -> 1 (the frozen base of the adapters is its random init)"):
        checkpointing.check_compatible(manifest, resolved(**{"model.peft.type": "lora", "seed": "1"}), "cpu")


def test_peft_file_names_and_base_names():
    from portable_fsdp.backends.hf_torch import adapters

    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert adapters.is_adapter(name)
    assert adapters.peft_key(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapters.base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("targets, chunked", [("q_proj,v_proj", True), ("q_proj,lm_head", False)])
def test_the_chunked_loss_takes_the_lm_head_unless_it_is_adapted(targets, chunked):
    # an adapted lm_head is peft's layer, not a Linear: the loss then falls back to the whole logits
    from portable_fsdp.backends.hf_torch import adapters, chunked_loss, model as model_lib
    from portable_fsdp.training.loss_chunks import Chunking

    config = resolved(**{"model.peft.type": "lora", "model.peft.target_modules": targets})
    model = model_lib.create_model(config, rank=0, rank0_only=False)
    adapters.add(model, config.model.peft)
    assert chunked_loss.install(model, Chunking(config.train.loss_chunk_tokens), "cpu") == chunked
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if adapters.is_adapter(n)}
