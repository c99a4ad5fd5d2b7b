"""Property: a Hugging Face fsdp_config JSON or Accelerate YAML of any shape — sections that are lists or numbers,
keys that are numbers, values of every type — loads, or is refused with one UserError line naming the file and
key; never another exception (a traceback for the user)."""
import json

import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from portable_fsdp.config import accelerate, validate
from portable_fsdp.config.hf_import import (NO_OP_KEYS, PARALLELISM_IGNORED, PARALLELISM_KEYS, PLAN_KEYS,
                                            apply_fsdp_file, apply_fsdp_option)
from portable_fsdp.config.schema import base_config
from portable_fsdp.errors import UserError

WORDS = st.sampled_from(["true", "false", "yes", "0", "1", "2", "FULL_SHARD", "NO_SHARD", "HYBRID_SHARD", "bf16",
                         "no", "LlamaDecoderLayer", "SIZE_BASED_WRAP", "torch", "allgather", "", "-1"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 9), st.floats(allow_nan=True), WORDS,
                    st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=6)


def section(keys):
    return st.dictionaries(st.one_of(st.sampled_from(sorted(keys)), st.text(max_size=6)), VALUES, max_size=5)


FSDP_KEYS = {*PLAN_KEYS, *(f"fsdp_{key}" for key in PLAN_KEYS), *NO_OP_KEYS, "version", "fsdp_version",
             "sharding_strategy", "fsdp_sharding_strategy"}
PARALLELISM = {f"parallelism_config_{name}" for name in [*PARALLELISM_KEYS, *PARALLELISM_IGNORED, "sp_seq_length"]}
TOP_KEYS = {*accelerate.PROCESS_KEYS, *accelerate.IGNORED_KEYS, "compute_environment", "distributed_type", "use_cpu",
            "mixed_precision", "use_parallelism_config"}
ACCELERATE_YAML = st.fixed_dictionaries(
    {"fsdp_config": st.one_of(section(FSDP_KEYS), VALUES)},
    optional={"parallelism_config": st.one_of(section(PARALLELISM), VALUES), 1: VALUES,
              **{key: VALUES for key in sorted(TOP_KEYS)}})
EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])


def loads_or_says_one_line(action):
    config = base_config()
    config.lock()
    try:
        action(config)
        validate.resolve_plan(config, 4)
    except UserError as err:
        assert err.field and err.message and "\n" not in err.line(), err.line()


@EXAMPLES
@given(data=st.one_of(section(FSDP_KEYS), VALUES))
def test_any_fsdp_json_loads_or_is_refused_in_one_line(tmp_path, data):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(data))
    loads_or_says_one_line(lambda config: apply_fsdp_file(config, str(path)))


@EXAMPLES
@given(data=ACCELERATE_YAML)
def test_any_accelerate_yaml_loads_or_is_refused_in_one_line(tmp_path, data):
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(data))
    loads_or_says_one_line(lambda config: (apply_fsdp_file(config, str(path)),
                                           accelerate.from_file(str(path), "cpu")))


@EXAMPLES
@given(option=VALUES)
def test_any_fsdp_option_is_taken_or_refused_in_one_line(option):
    loads_or_says_one_line(lambda config: apply_fsdp_option(config, option))
