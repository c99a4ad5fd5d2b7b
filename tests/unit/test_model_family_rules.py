"""The capability rules that read the model's own config.json (model.model_type, model.attention_dropout,
model.sliding_window: ModelInfo's fields), checked in-process with a ModelInfo written by hand."""
import dataclasses

import pytest

from portable_fsdp.backend import ModelInfo
from portable_fsdp.config.schema import apply_override, load_recipe
from portable_fsdp.config.validate import check_backend, resolve_plan
from tests.conftest import TEST_RECIPE
from tests.unit._helpers import user_error

LLAMA = ModelInfo(class_names=(), no_split_modules=(), n_params=1, n_layers=2, hidden_size=64, vocab_size=384,
                  model_type="llama", attention_dropout_key="attention_dropout")
GPT2 = dataclasses.replace(LLAMA, model_type="gpt2", attention_dropout=0.1, attention_dropout_key="attn_pdrop")
MISTRAL = dataclasses.replace(LLAMA, model_type="mistral", sliding_window=32)


def check(backend, model, overrides=(), device=None):
    config = load_recipe(TEST_RECIPE)
    for key, value in dict(overrides).items():
        apply_override(config, key, value)
    check_backend(config, resolve_plan(config, 2), backend, device or backend, 2, model)


@pytest.mark.parametrize("backend, model, overrides, field, fix", [
    ("flax", GPT2, {}, "model.model_type", "gpt2 is not implemented by --backend flax"),
    ("flax", dataclasses.replace(LLAMA, attention_dropout=0.1), {}, "model.attention_dropout",
     "set the model's attention_dropout to 0 in its config.json"),
    ("cpu", GPT2, {"plan.cp_size": "2"}, "model.attention_dropout", "set the model's attn_pdrop to 0 in its config.json"),
    ("cuda", GPT2, {"plan.cp_size": "2", "plan.cp_impl": "portable"}, "model.attention_dropout", "attn_pdrop to 0"),
    ("cpu", MISTRAL, {"plan.cp_size": "2"}, "model.sliding_window", "set data.seq_len to at most 32"),
])
def test_refused_with_the_fix(backend, model, overrides, field, fix):
    with user_error(field, fix):
        check(backend, model, overrides)


@pytest.mark.parametrize("backend, model, overrides", [
    ("flax", MISTRAL, {}), ("flax", dataclasses.replace(LLAMA, model_type="qwen2"), {}),
    ("cpu", GPT2, {}),  # dropout without context parallelism: the model's own attention applies it
    ("xla", GPT2, {"plan.cp_size": "2"}),  # the model's own attention on the sharded sequence
    ("cpu", MISTRAL, {"plan.cp_size": "2", "data.seq_len": "32"}),  # the window covers the sequence
    ("cpu", LLAMA, {"plan.cp_size": "2"}),
])
def test_honoured(backend, model, overrides):
    check(backend, model, overrides, device="CPU" if backend == "xla" else None)


def test_rules_about_the_model_do_not_apply_when_it_is_not_known():
    check("flax", None)  # plan_for without a backend's describe_model, the parity matrix
