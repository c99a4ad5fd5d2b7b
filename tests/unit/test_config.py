"""Recipes and command-line overrides (portable_fsdp/config/schema.py)."""
import textwrap

import ml_collections
import pytest

from portable_fsdp.config import schema as config_lib
from portable_fsdp.config.schema import apply_override, base_config, load_recipe, parse_value, set_field
from tests.conftest import ROOT, TEST_RECIPE
from tests.unit._helpers import user_error


def write_recipe(tmp_path, body, name="recipe.py"):
    path = tmp_path / name
    path.write_text("from portable_fsdp.config.schema import base_config\n\n" + textwrap.dedent(body))
    return path


@pytest.fixture
def config():
    return load_recipe(TEST_RECIPE)


# ---------------------------------------------------------------- load_recipe

def test_bundled_recipe_by_name_is_the_base_config():
    config = load_recipe("llama_tiny")
    assert config.to_dict() == base_config().to_dict()


def test_no_spec_loads_the_default_recipe():
    assert config_lib.DEFAULT_RECIPE == "llama_tiny"
    assert load_recipe(None).to_dict() == base_config().to_dict()


def test_recipe_path_with_variant():
    config = load_recipe(TEST_RECIPE)
    assert config.model.hidden_size == 64
    assert config.train.steps == 20
    assert config.data.seq_len == 64
    assert config.train.progress_bar is False


def test_relative_recipe_path_with_variant(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_recipe("portable_fsdp/configs/llama_tiny.py:test")
    assert config.model.num_hidden_layers == 2


def test_loaded_recipe_is_locked():
    config = load_recipe("llama_tiny")
    with pytest.raises((AttributeError, KeyError)):
        config.train.not_a_field = 1


def test_missing_recipe_file(tmp_path):
    missing = tmp_path / "nope.py"
    with user_error("--config", f"no such recipe file {missing}"):
        load_recipe(f"{missing}:test")


def test_unknown_bundled_recipe_name():
    with user_error("--config", "no bundled recipe 'no_such_recipe'"):
        load_recipe("no_such_recipe")


def test_recipe_without_get_config(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("X = 1\n")
    with user_error("--config", "defines no get_config(arg) function"):
        load_recipe(str(path))


def test_recipe_gets_its_argument(tmp_path):
    path = write_recipe(tmp_path, """
        def get_config(arg="none"):
            config = base_config()
            config.data.source = arg
            return config
    """)
    assert load_recipe(str(path)).data.source == "none"
    assert load_recipe(f"{path}:corpus.txt").data.source == "corpus.txt"


def test_unknown_variant_is_a_user_error():
    # llama_tiny.get_config raises ValueError for an unknown variant; a user's typo after ':' should
    # come back as one `error: --config: ...` line (exit 2), not a traceback.
    with user_error("--config", "bogus"):
        load_recipe(str(ROOT / "portable_fsdp" / "configs" / "llama_tiny.py") + ":bogus")


@pytest.mark.parametrize("line, field", [
    ("config.train.not_a_field = 1", "config.train.not_a_field"),
    ("config.extra = 1", "config.extra"),
    ("config.plan.fsdp_sizes = 2", "config.plan.fsdp_sizes"),
])
def test_recipe_adding_a_field_is_refused(tmp_path, line, field):
    path = write_recipe(tmp_path, f"""
        def get_config():
            config = base_config()
            {line}
            return config
    """)
    with user_error(field, "is not a field of the schema"):
        load_recipe(str(path))


def test_recipe_adding_a_section_is_refused(tmp_path):
    path = write_recipe(tmp_path, """
        import ml_collections

        def get_config():
            config = base_config()
            config.optim = ml_collections.ConfigDict({"name": "sgd"})
            return config
    """)
    with user_error("config.optim", "is not a field of the schema"):
        load_recipe(str(path))


# ---------------------------------------------------------------- apply_override

@pytest.mark.parametrize("raw", ["true", "True", "1", "yes", "on", " ON "])
def test_override_bool_true(config, raw):
    apply_override(config, "train.resume", raw)
    assert config.train.resume is True


@pytest.mark.parametrize("raw", ["false", "FALSE", "0", "no", "off"])
def test_override_bool_false(config, raw):
    config.unlock()
    config.train.progress_bar = True
    config.lock()
    apply_override(config, "train.progress_bar", raw)
    assert config.train.progress_bar is False


def test_override_bool_refuses_other_text(config):
    with user_error("config.train.resume", "expects a bool, got 'maybe'"):
        apply_override(config, "train.resume", "maybe")


def test_override_int(config):
    apply_override(config, "train.steps", "12")
    apply_override(config, "plan.fsdp_size", "-1")
    apply_override(config, "seed", " 7 ")
    assert config.train.steps == 12 and type(config.train.steps) is int
    assert config.plan.fsdp_size == -1
    assert config.seed == 7


@pytest.mark.parametrize("raw", ["abc", "1.5", "", "1e3", "true"])
def test_override_int_wrong_type(config, raw):
    with user_error("config.train.steps", f"expects an int, got {raw!r}"):
        apply_override(config, "train.steps", raw)
    assert config.train.steps == 20


def test_override_float(config):
    apply_override(config, "train.lr", "1e-4")
    assert config.train.lr == 1e-4
    apply_override(config, "train.weight_decay", "0")
    assert config.train.weight_decay == 0.0 and type(config.train.weight_decay) is float


def test_override_float_wrong_type(config):
    with user_error("config.train.lr", "expects a float, got 'fast'"):
        apply_override(config, "train.lr", "fast")


def test_override_str(config):
    apply_override(config, "data.source", "/data/corpus.txt")
    apply_override(config, "plan.transformer_layer_cls_to_wrap", "LlamaDecoderLayer,LlamaMLP")
    apply_override(config, "model.init_from", "")
    assert config.data.source == "/data/corpus.txt"
    assert config.plan.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer", "LlamaMLP"]  # a list field
    assert config.model.init_from == ""


def test_override_keeps_config_locked(config):
    apply_override(config, "train.steps", "3")
    with pytest.raises((AttributeError, KeyError)):
        config.train.new_field = 1


@pytest.mark.parametrize("dotted, suggestion", [
    ("train.stesp", "config.train.steps"),
    ("plan.fsdp_sizee", "config.plan.fsdp_size"),
    ("sed", "config.seed"),
    ("model.hiden_size", "config.model.hidden_size"),
])
def test_override_unknown_field_suggests(config, dotted, suggestion):
    with user_error(f"config.{dotted}", f"unknown field; did you mean {suggestion}?"):
        apply_override(config, dotted, "1")


def test_override_unknown_field_without_close_match(config):
    with user_error("config.zzzz.qqqq", "unknown field; see portable_fsdp/config/schema.py"):
        apply_override(config, "zzzz.qqqq", "1")


def test_override_misspelled_section_suggests_the_field(config):
    # `--config.trian.steps=3`: the closest field is train.steps, not some other field of train.
    with user_error("config.trian.steps", "did you mean config.train.steps?"):
        apply_override(config, "trian.steps", "3")


def test_override_below_a_leaf_names_the_whole_path(config):
    # `seed` is an int, so `seed.x` does not exist; the error must not call config.seed itself unknown.
    with user_error("config.seed.x", "config.seed is a value, not a section"):
        apply_override(config, "seed.x", "1")


@pytest.mark.parametrize("section", ["train", "plan", "model", "data"])
def test_override_whole_section_is_refused(config, section):
    before = config[section].to_dict()
    with user_error(f"config.{section}", "is a section; set one of its fields, e.g. --config." + section + "."):
        apply_override(config, section, "{}")
    assert config[section].to_dict() == before


# ---------------------------------------------------------------- parse_value

@pytest.mark.parametrize("raw, current, expected", [
    (" yes ", False, True),
    ("0", True, False),
    ("+3", 0, 3),
    ("-1", 5, -1),
    ("1_000", 0, 1000),
    ("2", 0.5, 2.0),
    ("-1.5e-3", 0.0, -1.5e-3),
    ("", "x", ""),
    ("  spaced ", "x", "  spaced "),
])
def test_parse_value(raw, current, expected):
    value = parse_value(raw, current, "f")
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_parse_value_refuses_non_finite_floats(raw):
    with user_error("f", "expects a finite number"):
        parse_value(raw, 1.0, "f")


@pytest.mark.parametrize("raw, current, kind", [
    ("2", False, "bool"),
    ("0x10", 0, "int"),
    ("1,5", 0.0, "float"),
])
def test_parse_value_refuses(raw, current, kind):
    article = "an" if kind[0] in "aeiou" else "a"
    with user_error("config.x", f"expects {article} {kind}, got {raw!r}"):
        parse_value(raw, current, "config.x")


@pytest.mark.parametrize("raw, current, expected", [
    ("A, B,,C", [], ["A", "B", "C"]),
    ("", ["x"], []),
    ('{"a": 1, "b": [true]}', {}, {"a": 1, "b": [True]}),
])
def test_parse_value_lists_and_mappings(raw, current, expected):
    assert parse_value(raw, current, "config.x") == expected


@pytest.mark.parametrize("current, kind", [(None, "NoneType"), ((1,), "tuple")])
def test_parse_value_unsupported_type(current, kind):
    with user_error("config.x", f"cannot be set from the command line (type {kind})"):
        parse_value("1", current, "config.x")


# ---------------------------------------------------------------- set_field (used by the fsdp_config importers)

def test_set_field_widens_int_to_float():
    config = base_config()
    set_field(config, "train.lr", 1, "src")
    assert config.train.lr == 1.0 and type(config.train.lr) is float


@pytest.mark.parametrize("dotted, value, kind", [
    ("plan.fsdp_size", True, "int"),
    ("plan.cpu_offload", 1, "bool"),
    ("plan.min_num_params", "100", "int"),
    ("plan.auto_wrap_policy", 3, "str"),
    ("train.lr", "0.1", "float"),
    ("train.lr", False, "float"),
])
def test_set_field_refuses_wrong_types(dotted, value, kind):
    config = base_config()
    with user_error("fsdp.json: key", f"must be a {kind} (got {value!r})"):
        set_field(config, dotted, value, "fsdp.json: key")


def test_set_field_on_locked_config():
    config = base_config()
    config.lock()
    set_field(config, "plan.cpu_offload", True, "src")
    assert config.plan.cpu_offload is True
    assert isinstance(config, ml_collections.ConfigDict) and config.is_locked


def test_a_mapping_keeps_dotted_keys(config):
    # tensor-parallel plans name modules by dotted patterns, from the command line and from files alike
    apply_override(config, "plan.tp_plan", '{"layers.*.mlp.up_proj": "colwise"}')
    assert config.plan.tp_plan.to_dict() == {"layers.*.mlp.up_proj": "colwise"}
    set_field(config, "plan.tp_plan", {"layers.*.mlp.down_proj": "rowwise"}, "fsdp.json: tp_plan")
    assert config.plan.tp_plan.to_dict() == {"layers.*.mlp.down_proj": "rowwise"}


def test_python_values_reach_the_config_as_the_command_line_writes_them():
    from portable_fsdp import api

    config = api.get_config(None, {"train.freeze": ["embed_tokens", "norm"], "train.steps": 5,
                                   "plan.cpu_offload": True, "plan.xla_fsdp_settings": {"compute_dtype": "bfloat16"}})
    assert config.train.freeze == ["embed_tokens", "norm"] and config.train.steps == 5 and config.plan.cpu_offload
    assert config.plan.xla_fsdp_settings.to_dict() == {"compute_dtype": "bfloat16"}


@pytest.mark.parametrize("recipe", ["llama3_8b", "qwen2_5_7b", "qwen3_30b_a3b"])
def test_big_model_recipes_save_sharded_and_export_full_at_the_end(recipe):
    import importlib

    module = importlib.import_module(f"portable_fsdp.configs.{recipe}")
    assert base_config().train.export_full_at_end is False
    for variant in module.VARIANTS:
        config = module.get_config(variant)
        assert config.plan.state_dict_type == "SHARDED_STATE_DICT" and config.train.export_full_at_end is True
