"""Property: any combination of command-line settings either passes start-up validation or fails with
one UserError naming a field — never another exception (which would be a traceback for the user)."""
import pathlib
import tempfile

from hypothesis import HealthCheck, given, settings, strategies as st

from portable_fsdp import backends
from portable_fsdp.config.schema import apply_override, load_recipe
from portable_fsdp.errors import UserError
from portable_fsdp.config.hf_import import apply_fsdp_dict
from portable_fsdp.launch.launcher import preflight

VALUES = {
    "plan.fsdp_size": st.sampled_from(["-1", "0", "1", "2", "3", "-5", "x"]),
    "plan.cp_size": st.sampled_from(["1", "2", "4", "0"]),
    "plan.tp_size": st.sampled_from(["1", "2"]),
    "plan.sp_size": st.sampled_from(["1", "2"]),
    "plan.auto_wrap_policy": st.sampled_from(["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP", "nope", ""]),
    "plan.min_num_params": st.sampled_from(["0", "1000", "-1"]),
    "plan.transformer_layer_cls_to_wrap": st.sampled_from(["", "LlamaDecoderLayer", "GPT2Block", ",,"]),
    "plan.state_dict_type": st.sampled_from(["FULL_STATE_DICT", "SHARDED_STATE_DICT", "full_state_dict", "?"]),
    "plan.param_dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
    "plan.cp_rotate_method": st.sampled_from(["allgather", "alltoall", "ring"]),
    "plan.cp_impl": st.sampled_from(["auto", "torch", "portable", "x"]),
    "plan.cpu_collectives": st.sampled_from(["auto", "gloo", "nccl"]),
    "plan.activation_checkpointing": st.sampled_from(["true", "false", "maybe"]),
    "plan.xla_fsdp_settings": st.sampled_from(["{}", "[]", "{bad", '{"compute_dtype": "bfloat16"}']),
    "train.gradient_checkpointing": st.sampled_from(["true", "false"]),
    "train.batch_size": st.sampled_from(["1", "2", "4", "6", "0", "-2"]),
    "train.grad_accum_steps": st.sampled_from(["1", "2", "3"]),
    "train.eval_batch_size": st.sampled_from(["2", "3"]),
    "train.lr": st.sampled_from(["1e-3", "0", "nan", "-1", "abc"]),
    "train.early_stopping_patience": st.sampled_from(["0", "2"]),
    "train.eval_every": st.sampled_from(["0", "5"]),
    "train.compute_metrics": st.sampled_from(["", "token_accuracy", "x:y"]),
    "train.nonfinite": st.sampled_from(["stop", "skip", "ignore"]),
    "data.seq_len": st.sampled_from(["64", "66", "0", "4096"]),
    "data.eval_fraction": st.sampled_from(["0.05", "0", "1.5"]),
    "data.document_masking": st.sampled_from(["true", "false"]),
    "model.vocab_size": st.sampled_from(["384", "100"]),
    "model.num_key_value_heads": st.sampled_from(["2", "3"]),
}
FSDP_JSON = st.dictionaries(st.sampled_from(["version", "reshard_after_forward", "cpu_offload", "sharding_strategy",
                                             "auto_wrap_policy", "min_num_params", "fsdp_offload_params", "typo_key",
                                             "xla_fsdp_settings"]),
                            st.one_of(st.booleans(), st.integers(-2, 3), st.sampled_from(["FULL_SHARD", "HYBRID_SHARD",
                                                                                          "NO_WRAP", "x"]), st.none()),
                            max_size=4)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.fixed_dictionaries({}, optional=VALUES), fsdp=FSDP_JSON, world_size=st.sampled_from([1, 2, 4]), backend=st.sampled_from(["cpu", "cuda", "xla", "flax"]))
def test_start_up_validation_never_raises_anything_but_a_user_error(overrides, fsdp, world_size, backend):
    config = load_recipe("llama_tiny:test")
    with tempfile.TemporaryDirectory() as workdir:
        try:
            apply_fsdp_dict(config, fsdp, "fsdp.json")
            for key, value in overrides.items():
                apply_override(config, key, value)
            backends.load(backend)
            preflight(config, backend, world_size, pathlib.Path(workdir))
        except UserError as err:
            assert err.field and err.message and "\n" not in err.line()
