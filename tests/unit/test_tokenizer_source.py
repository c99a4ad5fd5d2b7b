"""Which tokenizer a run reads: data.tokenizer when named, else model.init_from's, else bytes; a hub id is read
online, and offline the error names the download."""
import pytest

from portable_fsdp.config.schema import base_config
from portable_fsdp.data.tokenizers import (ByteTokenizer, LocalHFTokenizer, byte_tokenizer_for_transformers,
                                           load_tokenizer, resolve_tokenizer)
from portable_fsdp.errors import UserError


@pytest.fixture
def model_with_tokenizer(tmp_path):
    directory = tmp_path / "model"
    byte_tokenizer_for_transformers().save_pretrained(directory)
    return str(directory)


def resolved(init_from="", tokenizer=""):
    config = base_config()
    config.model.init_from, config.data.tokenizer = init_from, tokenizer
    resolve_tokenizer(config)
    return config.data.tokenizer


def test_init_from_names_the_tokenizer_unless_another_is_named(model_with_tokenizer, tmp_path):
    assert resolved() == "byte"
    assert resolved(init_from=model_with_tokenizer) == model_with_tokenizer
    assert resolved(init_from="meta-llama/Meta-Llama-3-8B") == "meta-llama/Meta-Llama-3-8B"
    assert resolved(init_from=model_with_tokenizer, tokenizer="byte") == "byte"
    (tmp_path / "weights_only").mkdir()
    assert resolved(init_from=str(tmp_path / "weights_only")) == "byte"


def test_the_resolved_names_load(model_with_tokenizer):
    assert isinstance(load_tokenizer(""), ByteTokenizer)
    assert isinstance(load_tokenizer(model_with_tokenizer), LocalHFTokenizer)


def test_a_hub_tokenizer_offline_is_one_line_naming_the_download(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as caught:
        load_tokenizer("nobody-here/no-such-model")
    line = caught.value.line()
    assert line.startswith("error: data.tokenizer: nobody-here/no-such-model is not a local directory") and \
        line.endswith("(hf download nobody-here/no-such-model --local-dir DIR) and set data.tokenizer=DIR")
    assert "\n" not in line
