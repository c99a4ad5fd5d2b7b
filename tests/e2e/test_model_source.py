"""Where a model comes from: any transformers causal-LM architecture by model_type, a config.json, a local
directory or a hub id (read through the hub when online; one line naming the fix when not)."""
import json

import pytest

from portable_fsdp.backends.hf_torch.model import describe_model, hf_config
from portable_fsdp.config.schema import apply_override, load_recipe
from tests.conftest import TEST_RECIPE
from tests.unit._helpers import user_error


def config_with(**overrides):
    config = load_recipe(TEST_RECIPE)
    for key, value in overrides.items():
        apply_override(config, key.replace("__", "."), value)
    return config


@pytest.mark.parametrize("architecture, root", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                                ("mistral", "MistralForCausalLM"), ("mixtral", "MixtralForCausalLM")])
def test_random_init_of_any_architecture_takes_the_size_fields(architecture, root):
    info = describe_model(config_with(model__architecture=architecture, model__num_hidden_layers="3"))
    assert (info.root_class, info.n_layers, info.hidden_size, info.num_key_value_heads) == (root, 3, 64, 2)


def test_config_overrides_set_keys_of_the_models_own_config():
    info = describe_model(config_with(model__architecture="mixtral",
                                      model__config_overrides='{"num_local_experts": 6, "num_experts_per_tok": 2}'))
    assert info.num_experts == 6


def test_config_from_a_config_json_takes_its_sizes(tmp_path):
    hf_config(config_with(model__architecture="qwen2", model__num_hidden_layers="5", model__hidden_size="96").model
              ).save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        info = describe_model(config_with(model__config_from=str(source)))
        assert (info.root_class, info.n_layers, info.hidden_size) == ("Qwen2ForCausalLM", 5, 96)


def test_an_unknown_architecture_names_the_close_ones():
    with user_error("model.architecture", "'lama' is not a transformers causal-LM model_type; did you mean llama"):
        describe_model(config_with(model__architecture="lama"))
    with user_error("model.architecture", "'vit' is not a transformers causal-LM model_type"):
        describe_model(config_with(model__architecture="vit"))


@pytest.mark.parametrize("field", ["model.init_from", "model.config_from"])
def test_a_hub_id_on_an_offline_machine_is_one_line_naming_the_download(field, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what an offline machine is told to set
    with user_error(field, "meta-llama/Llama-3.1-8B is not a local directory and could not be read from the Hugging "
                           "Face hub (HF_HUB_OFFLINE is set); download it where there is a network (hf "
                           f"download meta-llama/Llama-3.1-8B --local-dir DIR) and set {field}=DIR"):
        describe_model(config_with(**{field.replace(".", "__"): "meta-llama/Llama-3.1-8B"}))


def test_neither_a_directory_nor_a_hub_id(tmp_path):
    (tmp_path / "notes.json").write_text(json.dumps({}))
    with user_error("model.config_from", "a/b/c is not a local model directory (no config.json) or a hub id"):
        describe_model(config_with(model__config_from="a/b/c"))
