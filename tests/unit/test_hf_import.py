"""Hugging Face fsdp_config JSON and Accelerate YAML onto config.plan (portable_fsdp/config/hf_import.py)."""
import json
import textwrap
import warnings

import pytest

from portable_fsdp.config import validate
from portable_fsdp.config.schema import base_config
from portable_fsdp.config.hf_import import apply_fsdp_file, apply_fsdp_option, xla_settings_onto_spmd_plan
from portable_fsdp.errors import Notice
from portable_fsdp.plan import MixedPrecision, StateDictType, WrapPolicy
from tests.unit._helpers import user_error

HF_EXAMPLE = {"version": 2, "reshard_after_forward": True, "cpu_offload": False,
              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
              "state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": True,
              "activation_checkpointing": True}


@pytest.fixture
def config():
    config = base_config()
    config.lock()
    return config


def write_json(tmp_path, data, name="fsdp.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def write_yaml(tmp_path, text, name="accelerate.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def apply_quietly(config, path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a key we map must not also warn
        apply_fsdp_file(config, path)


# ---------------------------------------------------------------- fsdp.json

def test_hf_example_maps_onto_plan(config, tmp_path):
    config.plan.reshard_after_forward = False
    apply_quietly(config, write_json(tmp_path, HF_EXAMPLE))
    p = config.plan
    assert p.reshard_after_forward is True
    assert p.cpu_offload is False
    assert p.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert p.state_dict_type == "FULL_STATE_DICT"
    assert p.cpu_ram_efficient_loading is True
    assert p.activation_checkpointing is True
    plan = validate.resolve_plan(config, 2)
    assert plan.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert plan.activation_checkpointing and plan.cpu_ram_efficient_loading


def test_hf_example_leaves_other_fields_alone(config, tmp_path):
    before = config.to_dict()
    apply_fsdp_file(config, write_json(tmp_path, HF_EXAMPLE))
    after = config.to_dict()
    changed = {k for k in before["plan"] if before["plan"][k] != after["plan"][k]}
    assert changed == {"transformer_layer_cls_to_wrap", "cpu_ram_efficient_loading", "activation_checkpointing"}
    assert {k: v for k, v in before.items() if k != "plan"} == {k: v for k, v in after.items() if k != "plan"}


def test_fsdp_prefixed_keys(config, tmp_path):
    data = {"fsdp_version": 2, "fsdp_offload_params": True, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
            "fsdp_min_num_params": 100000, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_reshard_after_forward": False, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
    apply_quietly(config, write_json(tmp_path, data))
    p = config.plan
    assert p.cpu_offload is True
    assert p.auto_wrap_policy == "SIZE_BASED_WRAP" and p.min_num_params == 100000
    assert p.state_dict_type == "SHARDED_STATE_DICT"
    assert p.reshard_after_forward is False
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    plan = validate.resolve_plan(config, 1)
    assert plan.auto_wrap_policy is WrapPolicy.SIZE_BASED_WRAP
    assert plan.state_dict_type is StateDictType.SHARDED_STATE_DICT


def test_class_list_joined(config, tmp_path):
    apply_quietly(config, write_json(tmp_path, {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "LlamaMLP"]}))
    assert config.plan.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer", "LlamaMLP"]


def test_xla_keys_kept(config, tmp_path):
    settings = {"compute_dtype": "bfloat16", "shard_param_on_dim_0": True}
    apply_quietly(config, write_json(tmp_path, {"xla": True, "xla_fsdp_settings": settings,
                                                "xla_fsdp_grad_ckpt": True}))
    assert config.plan.xla is True
    assert config.plan.xla_fsdp_grad_ckpt is True
    assert config.plan.xla_fsdp_settings.to_dict() == settings
    plan = validate.plan_from_config(config)
    assert plan.xla.xla and plan.xla.xla_fsdp_grad_ckpt
    assert plan.xla.xla_fsdp_settings == settings


def test_xla_fsdp_settings_must_be_an_object(config, tmp_path):
    path = write_json(tmp_path, {"xla_fsdp_settings": "bfloat16"})
    with user_error(f"{path}: xla_fsdp_settings", "must be a JSON object"):
        apply_fsdp_file(config, path)


def test_string_booleans_accepted(config, tmp_path):
    apply_quietly(config, write_json(tmp_path, {"cpu_offload": "True", "reshard_after_forward": "false"}))
    assert config.plan.cpu_offload is True
    assert config.plan.reshard_after_forward is False


@pytest.mark.parametrize("strategy, reshard", [("FULL_SHARD", True), ("SHARD_GRAD_OP", False),
                                               ("shard_grad_op", False)])
def test_fsdp1_sharding_strategy(config, tmp_path, strategy, reshard):
    config.plan.reshard_after_forward = not reshard
    apply_quietly(config, write_json(tmp_path, {"version": 2, "fsdp_sharding_strategy": strategy}))
    assert config.plan.reshard_after_forward is reshard


@pytest.mark.parametrize("strategy", ["NO_SHARD", 3, "3", "_no_shard"])
def test_no_shard_is_ddp_every_rank_a_replica(config, tmp_path, strategy):
    """Hugging Face's NO_SHARD is DDP: nothing sharded (fsdp 1), the world replicated."""
    apply_quietly(config, write_json(tmp_path, {"sharding_strategy": strategy}))
    assert (config.plan.fsdp_size, config.plan.dp_replicate_size) == (1, -1)
    assert config.plan.reshard_after_forward is False
    mesh = validate.resolve_plan(config, 4).mesh
    assert (mesh.dp_replicate_size, mesh.fsdp_size, mesh.data_parallel_size) == (4, 1, 4)


@pytest.mark.parametrize("version", [1, "1"])
def test_fsdp1_file_runs_fsdp2_and_says_what_differs(config, tmp_path, version):
    path = write_json(tmp_path, {"version": version, "sharding_strategy": "FULL_SHARD", "use_orig_params": True})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        apply_fsdp_file(config, path)
    lines = [str(w.message) for w in record]
    assert any(line.startswith(f"{path}: version: FSDP1 runs as FSDP2 here: parameters are sharded one by one as "
                               "DTensors instead of flattened into FlatParameters, so use_orig_params has no meaning")
               for line in lines), lines
    assert all(issubclass(w.category, Notice) for w in record)
    assert config.plan.reshard_after_forward is True


# What `accelerate config` writes for FSDP1 (fsdp_version 1): the strategy under fsdp_reshard_after_forward,
# by name, or by number in older files.
ACCELERATE_FSDP1_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: {strategy}
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.mark.parametrize("strategy, reshard", [("FULL_SHARD", True), ("SHARD_GRAD_OP", False), (1, True), (2, False),
                                               ("true", True), ("false", False)])
def test_accelerate_fsdp1_yaml_strategy_in_reshard_after_forward(config, tmp_path, strategy, reshard):
    config.plan.reshard_after_forward = not reshard
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the FSDP1 prefetch / use_orig_params knobs: tested elsewhere
        apply_fsdp_file(config, write_yaml(tmp_path, ACCELERATE_FSDP1_YAML.format(strategy=strategy)))
    assert config.plan.reshard_after_forward is reshard
    plan = validate.plan_from_config(config)
    assert plan.state_dict_type is StateDictType.SHARDED_STATE_DICT and plan.cpu_ram_efficient_loading
    assert plan.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert plan.mixed_precision == MixedPrecision("bfloat16", "float32")


@pytest.mark.parametrize("strategy, phrase", [("EVERYTHING", "unknown sharding strategy 'EVERYTHING'"),
                                              (7, "unknown sharding strategy 7")])
def test_accelerate_fsdp1_yaml_strategy_without_equivalent(config, tmp_path, strategy, phrase):
    path = write_yaml(tmp_path, ACCELERATE_FSDP1_YAML.format(strategy=strategy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with user_error(f"{path}: reshard_after_forward", phrase):
            apply_fsdp_file(config, path)


@pytest.mark.parametrize("text, reshard, offload", [("full_shard auto_wrap", True, False),
                                                    ("shard_grad_op auto_wrap offload", False, True),
                                                    ("full_shard offload", True, True)])
def test_trainer_fsdp_option_string(config, text, reshard, offload):
    config.plan.reshard_after_forward = not reshard
    apply_fsdp_option(config, text)
    assert config.plan.reshard_after_forward is reshard and config.plan.cpu_offload is offload
    assert config.plan.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("text, field, phrase", [
    ("full_shard autowrap", "--fsdp: autowrap", "is not an fsdp option; choose from full_shard, shard_grad_op, "
                                                "hybrid_shard, hybrid_shard_zero2, no_shard, offload, auto_wrap"),
    ("maybe", "--fsdp: maybe", "is not an fsdp option"),
    ([1], "--fsdp", "must be option words such as 'full_shard auto_wrap', or true (got [1])"),
])
def test_trainer_fsdp_option_string_refusals(config, text, field, phrase):
    with user_error(field, phrase):
        apply_fsdp_option(config, text)


@pytest.mark.parametrize("key", ["backward_prefetch", "fsdp_forward_prefetch", "use_orig_params",
                                 "fsdp_sync_module_states", "limit_all_gathers"])
def test_no_op_fsdp1_keys_warn(config, tmp_path, key):
    before = config.to_dict()
    path = write_json(tmp_path, {key: True})
    bare = key[len("fsdp_"):] if key.startswith("fsdp_") else key
    with pytest.warns(UserWarning, match=f"{bare} has no effect with FSDP2"):
        apply_fsdp_file(config, path)
    assert config.to_dict() == before


def test_unknown_key(config, tmp_path):
    path = write_json(tmp_path, {"fsdp_offload_everything": True})
    with user_error(f"{path}: offload_everything", "is not an FSDP setting") as info:
        apply_fsdp_file(config, path)
    assert "transformer_layer_cls_to_wrap" in info.value.message


@pytest.mark.parametrize("key, value, phrase", [
    ("cpu_offload", "maybe", "must be true or false (got 'maybe')"),
    ("cpu_offload", 2, "must be true or false (got 2)"),
    ("min_num_params", 1.5, "must be a int (got 1.5)"),
    ("min_num_params", "many", "must be an integer (got 'many')"),
    ("reshard_after_forward", 1.5, "unknown sharding strategy 1.5; write true/false, FULL_SHARD, SHARD_GRAD_OP, "
                                   "HYBRID_SHARD, HYBRID_SHARD_ZERO2 or NO_SHARD (FSDP1's 1-5)"),
    ("auto_wrap_policy", 2, "must be a str (got 2)"),
    ("transformer_layer_cls_to_wrap", ["LlamaDecoderLayer", 3], "must be a list of names"),
])
def test_wrong_type(config, tmp_path, key, value, phrase):
    path = write_json(tmp_path, {key: value})
    with user_error(f"{path}: {key}", phrase):
        apply_fsdp_file(config, path)


@pytest.mark.parametrize("version", [3, 0, "two", 2.0, True, None])
def test_bad_version(config, tmp_path, version):
    path = write_json(tmp_path, {"version": version})
    with user_error(f"{path}: version", f"must be 1 or 2 (got {version!r})"):
        apply_fsdp_file(config, path)


def test_malformed_json(config, tmp_path):
    path = write_json(tmp_path, '{"version": 2,\n "cpu_offload": }')
    with user_error("--fsdp_config", "is not valid JSON (line 2"):
        apply_fsdp_file(config, path)


@pytest.mark.parametrize("text", ["[1, 2]", '"FULL_SHARD"', "null"])
def test_non_object_json(config, tmp_path, text):
    path = write_json(tmp_path, text)
    with user_error("--fsdp_config", "must hold a JSON object"):
        apply_fsdp_file(config, path)


def test_missing_file(config, tmp_path):
    path = str(tmp_path / "nope.json")
    with user_error("--fsdp_config", f"no such file {path}"):
        apply_fsdp_file(config, path)


def test_directory_is_not_a_file(config, tmp_path):
    with user_error("--fsdp_config", "no such file"):
        apply_fsdp_file(config, str(tmp_path))


# ---------------------------------------------------------------- Accelerate YAML

ACCELERATE_YAML = """\
    compute_environment: LOCAL_MACHINE
    debug: false
    distributed_type: FSDP
    downcast_bf16: 'no'
    fsdp_config:
      fsdp_version: 2
      fsdp_offload_params: true
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
      fsdp_reshard_after_forward: false
      fsdp_state_dict_type: SHARDED_STATE_DICT
      fsdp_activation_checkpointing: true
      fsdp_cpu_ram_efficient_loading: 'true'
    machine_rank: 0
    main_training_function: main
    mixed_precision: bf16
    num_machines: 1
    num_processes: 4
    parallelism_config:
      parallelism_config_cp_size: 2
    use_cpu: false
"""


def test_accelerate_yaml(config, tmp_path):
    apply_quietly(config, write_yaml(tmp_path, ACCELERATE_YAML))
    p = config.plan
    assert p.cpu_offload is True
    assert p.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert p.reshard_after_forward is False
    assert p.state_dict_type == "SHARDED_STATE_DICT"
    assert p.activation_checkpointing is True
    assert p.cpu_ram_efficient_loading is True
    assert p.param_dtype == "bfloat16"
    assert p.cp_size == 2
    plan = validate.plan_from_config(config)
    assert plan.mesh.cp_size == 2
    assert plan.mixed_precision.param_dtype == "bfloat16"
    assert validate.resolve_plan(config, 4).mesh.fsdp_size == 2  # cp_size reaches the mesh


def test_accelerate_yml_suffix_and_class_list_string(config, tmp_path):
    path = write_yaml(tmp_path, """\
        fsdp_config:
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer, LlamaMLP
        mixed_precision: fp16
    """, name="acc.yml")
    apply_quietly(config, path)
    assert validate.plan_from_config(config).transformer_layer_cls_to_wrap == ("LlamaDecoderLayer", "LlamaMLP")
    assert config.plan.param_dtype == "float16"


@pytest.mark.parametrize("line", ["mixed_precision: 'no'", ""])
def test_accelerate_yaml_no_mixed_precision(config, tmp_path, line):
    path = write_yaml(tmp_path, f"fsdp_config:\n  fsdp_offload_params: false\n{line}\n")
    apply_quietly(config, path)
    assert validate.plan_from_config(config).mixed_precision == MixedPrecision("float32", "float32")


def test_accelerate_yaml_unquoted_no_mixed_precision(config, tmp_path):
    # YAML 1.1 reads an unquoted `no` as False; a user who wrote `mixed_precision: no` means 'no'.
    path = write_yaml(tmp_path, "fsdp_config:\n  fsdp_offload_params: false\nmixed_precision: no\n")
    apply_fsdp_file(config, path)
    assert config.plan.param_dtype == "float32"


def test_accelerate_yaml_unknown_mixed_precision(config, tmp_path):
    path = write_yaml(tmp_path, "fsdp_config:\n  fsdp_offload_params: false\nmixed_precision: fp8\n")
    with user_error(f"{path}: mixed_precision", "unknown value 'fp8'; choose one of no, fp16, bf16"):
        apply_fsdp_file(config, path)


def test_accelerate_yaml_bad_cp_size_type(config, tmp_path):
    path = write_yaml(tmp_path, """\
        fsdp_config:
          fsdp_version: 2
        parallelism_config:
          parallelism_config_cp_size: two
    """)
    with user_error(f"{path}: parallelism_config_cp_size", "must be an integer (got 'two')"):
        apply_fsdp_file(config, path)


@pytest.mark.parametrize("key, field", [("tp_size", "tp_size"), ("dp_replicate_size", "dp_replicate_size"),
                                        ("dp_shard_size", "fsdp_size"), ("cp_size", "cp_size"), ("sp_size", "sp_size")])
def test_accelerate_yaml_parallelism_sizes_reach_the_mesh(config, tmp_path, key, field):
    path = write_yaml(tmp_path, f"fsdp_config:\n  fsdp_version: 2\nparallelism_config:\n  parallelism_config_{key}: 2\n")
    apply_fsdp_file(config, path)
    assert config.plan[field] == 2


@pytest.mark.parametrize("strategy, reshard", [("HYBRID_SHARD", True), ("HYBRID_SHARD_ZERO2", False),
                                               ("_HYBRID_SHARD_ZERO2", False), (4, True), (5, False)])
@pytest.mark.parametrize("machines", [1, 2])
def test_hybrid_strategy_replicates_across_the_machines(config, tmp_path, strategy, reshard, machines):
    # FSDP1's hybrid strategies shard within a machine and replicate across machines: HSDP with one replica
    # per machine (on one machine, plain FSDP as Accelerate runs it)
    path = write_yaml(tmp_path, f"num_machines: {machines}\nfsdp_config:\n  fsdp_sharding_strategy: {strategy}\n")
    apply_fsdp_file(config, path)
    assert (config.plan.dp_replicate_size, config.plan.reshard_after_forward) == (machines, reshard)


@pytest.mark.parametrize("environment, machines", [
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "3"}, 2),  # torchrun --nnodes 2 --nproc-per-node 8
    ({"SLURM_JOB_NUM_NODES": "4"}, 4),
    ({"SLURM_NNODES": "3"}, 3),
])
def test_hybrid_strategy_replicates_over_the_machines_the_launcher_reports(config, tmp_path, monkeypatch,
                                                                           environment, machines):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    apply_quietly(config, write_json(tmp_path, {"sharding_strategy": "HYBRID_SHARD_ZERO2"}))
    assert (config.plan.dp_replicate_size, config.plan.reshard_after_forward) == (machines, False)
    config.plan.dp_replicate_size = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_fsdp_option(config, "hybrid_shard auto_wrap")
    assert (config.plan.dp_replicate_size, config.plan.reshard_after_forward) == (machines, True)


def test_hybrid_strategy_on_one_machine_says_it_runs_as_full_shard(config, tmp_path, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    path = write_json(tmp_path, {"sharding_strategy": "HYBRID_SHARD"})
    with pytest.warns(Notice) as record:
        apply_fsdp_file(config, path)
    assert [str(w.message) for w in record] == [
        f"{path}: sharding_strategy: a hybrid strategy replicates across machines and this launcher reports one, so "
        "it shards over every rank as FULL_SHARD does; run on several machines, or set plan.dp_replicate_size"]
    assert config.plan.dp_replicate_size == 1


def test_accelerate_yaml_fsdp1_keys(config, tmp_path):
    path = write_yaml(tmp_path, """\
        fsdp_config:
          fsdp_sharding_strategy: SHARD_GRAD_OP
          fsdp_backward_prefetch: BACKWARD_PRE
          fsdp_use_orig_params: true
        mixed_precision: 'no'
    """)
    with pytest.warns(UserWarning) as record:
        apply_fsdp_file(config, path)
    assert config.plan.reshard_after_forward is False
    assert sorted(str(w.message).split(": ")[1].split()[0] for w in record) == ["backward_prefetch", "use_orig_params"]


@pytest.mark.parametrize("text", ["distributed_type: FSDP\nmixed_precision: bf16\n",
                                  "distributed_type: FSDP\nfsdp_config: {}\n"])
def test_yaml_without_fsdp_config(config, tmp_path, text):
    path = write_yaml(tmp_path, text)
    with user_error("--fsdp_config", "has no fsdp_config section"):
        apply_fsdp_file(config, path)


@pytest.mark.parametrize("text, key, got", [("fsdp_config: FULL_SHARD\n", "fsdp_config", "'FULL_SHARD'"),
                                            ("fsdp_config:\n  fsdp_version: 2\nparallelism_config: [1]\n",
                                             "parallelism_config", "[1]"),
                                            ("fsdp_config:\n  fsdp_version: 2\nparallelism_config: 4\n",
                                             "parallelism_config", "4")])
def test_yaml_section_that_is_not_a_mapping(config, tmp_path, text, key, got):
    path = write_yaml(tmp_path, text)
    with user_error(f"{path}: {key}", f"must be a mapping of settings (got {got})"):
        apply_fsdp_file(config, path)


@pytest.mark.parametrize("text, where", [("1: 2\nfsdp_config:\n  fsdp_version: 2\n", ""),
                                         ("fsdp_config:\n  true: 2\n", ": fsdp_config")])
def test_yaml_key_that_is_not_a_name(config, tmp_path, text, where):
    path = write_yaml(tmp_path, text)
    with user_error(f"{path}{where}", "is not a name"):
        apply_fsdp_file(config, path)


def test_malformed_yaml(config, tmp_path):
    path = write_yaml(tmp_path, "fsdp_config:\n  fsdp_version: [2\n  other: : :\n")
    with user_error("--fsdp_config", "is not valid YAML"):
        apply_fsdp_file(config, path)


@pytest.mark.parametrize("text", ["- fsdp_config\n", "just a string\n", ""])
def test_yaml_not_a_mapping(config, tmp_path, text):
    path = write_yaml(tmp_path, text)
    with user_error("--fsdp_config", "must hold a YAML mapping"):
        apply_fsdp_file(config, path)


def test_yaml_unknown_fsdp_key(config, tmp_path):
    path = write_yaml(tmp_path, "fsdp_config:\n  fsdp_wrap_everything: true\n")
    with user_error(f"{path}: wrap_everything", "is not an FSDP setting"):
        apply_fsdp_file(config, path)


def test_parallelism_backends_are_ignored_by_name(config, tmp_path):
    path = write_yaml(tmp_path, """\
        fsdp_config:
          fsdp_version: 2
        parallelism_config:
          parallelism_config_cp_size: 2
          parallelism_config_cp_comm_strategy: alltoall
          parallelism_config_cp_backend: torch
          parallelism_config_sp_backend: deepspeed
    """)
    with pytest.warns(Notice) as record:
        apply_fsdp_file(config, path)
    assert [str(w.message) for w in record] == [  # cp_backend torch, Accelerate's only one, asks nothing
        f"{path}: parallelism_config_sp_backend is ignored: plan.sp_size is lowered by each backend itself, not "
        "through DeepSpeed"]
    assert config.plan.cp_size == 2 and config.plan.cp_rotate_method == "alltoall"  # cp_comm_strategy


# The TPU fsdp_config of Hugging Face's guide (xla, xla_fsdp_settings, xla_fsdp_grad_ckpt), as TPU users have it.
HF_TPU_CONFIG = {"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "xla": True,
                 "xla_fsdp_settings": {"compute_dtype": "bfloat16", "fp32_reduce_scatter": True},
                 "xla_fsdp_grad_ckpt": True}


HF_TPU_V2_CONFIG = {**HF_TPU_CONFIG, "xla_fsdp_v2": True}


def test_hf_tpu_config_on_spmd_fsdpv2_moves_its_settings_onto_the_plan(config, tmp_path):
    apply_quietly(config, write_json(tmp_path, HF_TPU_V2_CONFIG))
    xla_settings_onto_spmd_plan(config)
    assert config.plan.param_dtype == "bfloat16" and config.plan.reduce_dtype == "float32"
    assert config.plan.xla_fsdp_settings.to_dict() == {}  # nothing left for FSDP v1 options
    plan = validate.plan_from_config(config)
    assert plan.activation_checkpointing and plan.xla.xla and plan.xla.xla_fsdp_v2


def test_hf_tpu_config_with_fsdp_v1_keeps_its_settings(config, tmp_path):
    apply_quietly(config, write_json(tmp_path, HF_TPU_CONFIG))  # FSDP v1: no xla_fsdp_v2, as Trainer reads it
    xla_settings_onto_spmd_plan(config)
    assert config.plan.param_dtype == "float32"  # FSDP v1 reads compute_dtype itself
    assert config.plan.xla_fsdp_settings.to_dict() == HF_TPU_CONFIG["xla_fsdp_settings"]


def test_hf_tpu_config_contradicting_the_plan_names_both(config, tmp_path):
    apply_quietly(config, write_json(tmp_path, HF_TPU_V2_CONFIG))
    config.plan.param_dtype = "float16"
    with user_error("plan.xla_fsdp_settings", "key 'compute_dtype' = bfloat16 contradicts plan.param_dtype=float16"):
        xla_settings_onto_spmd_plan(config)


def test_fp32_reduce_scatter_false_means_reducing_in_the_compute_dtype(config, tmp_path):
    settings = {"compute_dtype": "torch.bfloat16", "fp32_reduce_scatter": False}
    apply_quietly(config, write_json(tmp_path, {**HF_TPU_V2_CONFIG, "xla_fsdp_settings": settings}))
    xla_settings_onto_spmd_plan(config)
    assert (config.plan.param_dtype, config.plan.reduce_dtype) == ("bfloat16", "bfloat16")


def test_trainer_fsdp_option_string_with_two_strategies(config):
    with user_error("--fsdp", "names two sharding strategies (full_shard and shard_grad_op); keep one"):
        apply_fsdp_option(config, "full_shard shard_grad_op auto_wrap")
    with user_error("--fsdp", "names two sharding strategies (shard_grad_op and hybrid_shard); keep one"):
        apply_fsdp_option(config, "shard_grad_op hybrid_shard")


def test_fp32_reduce_scatter_contradicting_the_plan_names_both(config, tmp_path):
    apply_quietly(config, write_json(tmp_path, HF_TPU_V2_CONFIG))
    config.plan.reduce_dtype = "bfloat16"
    with user_error("plan.xla_fsdp_settings", "key 'fp32_reduce_scatter' = true contradicts plan.reduce_dtype=bfloat16"):
        xla_settings_onto_spmd_plan(config)


# ---------------------------------------------------------------- values as Hugging Face's parsers read them

@pytest.mark.parametrize("data, field, value", [
    ({"version": "2"}, "reshard_after_forward", True),
    ({"cpu_offload": "yes"}, "cpu_offload", True),
    ({"cpu_offload": 1}, "cpu_offload", True),
    ({"cpu_offload": "0"}, "cpu_offload", False),
    ({"fsdp_offload_params": "on"}, "cpu_offload", True),
    ({"activation_checkpointing": "true"}, "activation_checkpointing", True),
    ({"cpu_ram_efficient_loading": "True"}, "cpu_ram_efficient_loading", True),
    ({"reshard_after_forward": "false"}, "reshard_after_forward", False),
    ({"reshard_after_forward": "no"}, "reshard_after_forward", False),
    ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": "100000"}, "min_num_params", 100000),
])
def test_values_as_hugging_face_reads_them(config, tmp_path, data, field, value):
    apply_quietly(config, write_json(tmp_path, data))
    assert config.plan[field] == value and type(config.plan[field]) is type(value)


@pytest.mark.parametrize("option", ["True", "true", True])
def test_fsdp_true_is_fsdp_with_the_defaults(config, option):
    before = config.to_dict()
    apply_fsdp_option(config, option)
    assert config.to_dict() == before


@pytest.mark.parametrize("option", ["False", False])
def test_fsdp_false_is_ddp(config, option):
    apply_fsdp_option(config, option)
    assert (config.plan.fsdp_size, config.plan.dp_replicate_size) == (1, -1)


def test_trainer_fsdp_option_list(config):
    apply_fsdp_option(config, ["shard_grad_op", "offload"])
    assert config.plan.reshard_after_forward is False and config.plan.cpu_offload is True


@pytest.mark.parametrize("key, field", [("fsdp_size", "fsdp_size"), ("tp_size", "tp_size"), ("ep_size", "ep_size"),
                                        ("dp_replicate_size", "dp_replicate_size")])
def test_mesh_sizes_as_transformers_distributed_config_names_them(config, tmp_path, key, field):
    """fsdp_size is read as itself, not as "size" with the fsdp_ prefix stripped."""
    apply_quietly(config, write_json(tmp_path, {key: 2}))
    assert config.plan[field] == 2
    config.plan[field] = 1
    apply_fsdp_file(config, write_yaml(tmp_path, f"fsdp_config:\n  fsdp_version: 2\nparallelism_config:\n  {key}: 2\n"))
    assert config.plan[field] == 2


def test_parallelism_ep_size_key(config, tmp_path):
    apply_fsdp_file(config, write_yaml(tmp_path, "fsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
                                                 "  parallelism_config_ep_size: 2\n"))
    assert config.plan.ep_size == 2


def test_a_key_with_a_line_break_is_still_one_error_line(config, tmp_path):
    path = write_json(tmp_path, {"cpu_\noffload": True})
    with user_error(f"{path}: cpu_\\noffload", "is not an FSDP setting") as info:
        apply_fsdp_file(config, path)
    assert "\n" not in info.value.line()
