"""Accelerate's launch flags for its ParallelismConfig, as the Hugging Face guide's recipes write them
(`--use_parallelism_config --parallelism_config_cp_size 2 ...`), read by `python -m portable_fsdp.run` with the
meaning Accelerate gives them (portable_fsdp/run.py, config/hf_import.py)."""
import warnings

import pytest

from portable_fsdp import run
from portable_fsdp.config import validate
from portable_fsdp.config.schema import base_config
from portable_fsdp.errors import Notice
from tests.unit._helpers import user_error


@pytest.fixture
def config():
    config = base_config()
    config.lock()
    return config


def apply(config, *argv):
    args, overrides = run.parse_args(list(argv))
    assert overrides == []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run.apply_parallelism_flags(config, args)
    assert all(issubclass(w.category, Notice) for w in record)
    return [str(w.message) for w in record]


def test_the_guides_context_parallel_launch(config):
    notices = apply(config, "--use_parallelism_config", "--parallelism_config_cp_size", "2",
                    "--parallelism_config_dp_shard_size=2", "--parallelism_config_cp_comm_strategy", "alltoall")
    assert notices == []
    assert (config.plan.cp_size, config.plan.fsdp_size, config.plan.cp_rotate_method) == (2, 2, "alltoall")
    assert validate.resolve_plan(config, 4).mesh.cp_size == 2


@pytest.mark.parametrize("flag, field", [("dp_replicate_size", "dp_replicate_size"), ("dp_shard_size", "fsdp_size"),
                                         ("tp_size", "tp_size"), ("cp_size", "cp_size"), ("sp_size", "sp_size"),
                                         ("ep_size", "ep_size")])
def test_each_size_flag_reaches_its_mesh_axis(config, flag, field):
    apply(config, "--use_parallelism_config", f"--parallelism_config_{flag}", "2")
    assert config.plan[field] == 2


def test_a_lone_size_flag_is_ignored_as_accelerate_ignores_it(config):
    """The guide: "a lone --parallelism_config_cp_size is ignored and keeps cp_size=1"."""
    notices = apply(config, "--parallelism_config_cp_size", "2", "--parallelism_config_tp_size", "2")
    assert notices == ["--parallelism_config_tp_size, --parallelism_config_cp_size are ignored: Accelerate reads the "
                       "--parallelism_config_* flags only with --use_parallelism_config"]
    assert (config.plan.cp_size, config.plan.tp_size) == (1, 1)


def test_sequence_parallel_flags(config):
    config.data.seq_len = 64
    notices = apply(config, "--use_parallelism_config", "--parallelism_config_sp_size", "2",
                    "--parallelism_config_sp_seq_length", "64", "--parallelism_config_sp_seq_length_is_variable",
                    "false", "--parallelism_config_sp_backend", "deepspeed",
                    "--parallelism_config_sp_attn_implementation", "sdpa")
    assert config.plan.sp_size == 2
    assert notices == ["--parallelism_config_sp_backend is ignored: plan.sp_size is lowered by each backend itself, "
                       "not through DeepSpeed"]


def test_a_fixed_sequence_length_that_is_not_the_batches_is_refused(config):
    config.data.seq_len = 64
    with user_error("--parallelism_config_sp_seq_length", "128 is not the length of every batch here, "
                    "data.seq_len=64; set data.seq_len=128 or drop the setting"):
        apply(config, "--use_parallelism_config", "--parallelism_config_sp_seq_length", "128",
              "--parallelism_config_sp_seq_length_is_variable", "False")
    apply(config, "--use_parallelism_config", "--parallelism_config_sp_seq_length", "128")  # variable: asks nothing


def test_another_attention_kernel_is_named_as_ignored(config):
    notices = apply(config, "--use_parallelism_config", "--parallelism_config_sp_attn_implementation",
                    "flash_attention_2")
    assert notices == ["--parallelism_config_sp_attn_implementation is ignored: attention runs as "
                       "model.attn_implementation says"]


@pytest.mark.parametrize("argv, field, phrase", [
    (["--parallelism_config_cp_size", "two"], "--parallelism_config_cp_size", "must be an integer (got 'two')"),
    (["--parallelism_config_cp_comm_strategy", "ring"], "plan.cp_rotate_method", "unknown value 'ring'"),
    (["--parallelism_config_sp_seq_length_is_variable", "sometimes"],
     "--parallelism_config_sp_seq_length_is_variable", "must be true or false (got 'sometimes')"),
])
def test_bad_flag_values_are_one_line(config, argv, field, phrase):
    with user_error(field, phrase):
        apply(config, "--use_parallelism_config", *argv)
        validate.resolve_plan(config, 4)


def test_use_parallelism_config_at_the_top_of_a_yaml_applies_its_section_quietly(config, tmp_path):
    from portable_fsdp.config.hf_import import apply_fsdp_file

    path = tmp_path / "accelerate.yaml"
    path.write_text("use_parallelism_config: true\nfsdp_config:\n  fsdp_version: 2\n"
                    "parallelism_config:\n  parallelism_config_tp_size: 2\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_fsdp_file(config, str(path))
        from portable_fsdp.config import accelerate

        accelerate.from_file(str(path), "cpu")
    assert config.plan.tp_size == 2
    path.write_text(path.read_text().replace("true", "false", 1))
    config.plan.tp_size = 1
    with pytest.warns(Notice, match="parallelism_config is ignored: use_parallelism_config is false"):
        apply_fsdp_file(config, str(path))
    assert config.plan.tp_size == 1
