"""The neutral plan (portable_fsdp/plan.py) and start-up validation (portable_fsdp/config/validate.py)."""
import dataclasses
import math

import pytest

from portable_fsdp import plan as plan_lib
from portable_fsdp.config import schema as config_lib, validate
from portable_fsdp.config.schema import apply_override, base_config
from portable_fsdp.backend import ModelInfo
from portable_fsdp.plan import MeshSpec, MixedPrecision, ShardingPlan, StateDictType, WrapPolicy, plan_fields
from tests.unit._helpers import user_error


# ---------------------------------------------------------------- MeshSpec.resolve

@pytest.mark.parametrize("world, others, expected", [
    (1, {}, 1),
    (8, {}, 8),
    (8, {"cp_size": 2}, 4),
    (8, {"tp_size": 2, "ep_size": 2}, 4),
    (6, {"sp_size": 3}, 2),
    (8, {"dp_replicate_size": 2, "tp_size": 2}, 2),
])
def test_resolve_infers_fsdp_size(world, others, expected):
    mesh = MeshSpec(fsdp_size=-1, **others).resolve(world)
    assert mesh.fsdp_size == expected
    assert mesh.fsdp_size * math.prod(mesh.other_axes().values()) == world


def test_resolve_keeps_explicit_sizes_that_match():
    mesh = MeshSpec(fsdp_size=2, cp_size=2).resolve(4)
    assert mesh == MeshSpec(fsdp_size=2, cp_size=2)


def test_resolve_returns_new_spec_and_leaves_original():
    spec = MeshSpec()
    resolved = spec.resolve(4)
    assert spec.fsdp_size == -1 and resolved.fsdp_size == 4


def test_resolve_cannot_infer_when_others_do_not_divide_world():
    with user_error("plan.fsdp_size", "cannot infer") as info:
        MeshSpec(cp_size=3).resolve(4)
    assert "world size 4" in info.value.message and "= 3" in info.value.message


@pytest.mark.parametrize("spec, world", [
    (MeshSpec(fsdp_size=2), 4),
    (MeshSpec(fsdp_size=4), 2),
    (MeshSpec(fsdp_size=2, tp_size=2), 2),
])
def test_resolve_product_not_world_size(spec, world):
    with user_error("plan.fsdp_size", f"but the world size is {world}"):
        spec.resolve(world)


@pytest.mark.parametrize("field, size", [
    ("fsdp_size", 0), ("fsdp_size", -2),
    ("cp_size", 0), ("cp_size", -1), ("tp_size", 0), ("tp_size", -1),
    ("ep_size", 0), ("ep_size", -3), ("sp_size", 0), ("sp_size", -1),
    ("dp_replicate_size", 0), ("dp_replicate_size", -2),
])
def test_resolve_refuses_zero_and_negative_sizes(field, size):
    with user_error(f"plan.{field}", f"must be a positive integer (got {size})"):
        MeshSpec(**{field: size}).resolve(4)


def test_data_parallel_size_counts_replicas_and_fsdp_only():
    # cp, sp and tp ranks share a batch; ep ranks come from fsdp × tp, which split the rows no further
    mesh = MeshSpec(dp_replicate_size=2, fsdp_size=2, cp_size=2, tp_size=2, ep_size=2)
    assert mesh.data_parallel_size == 4


@pytest.mark.parametrize("world, sizes, ep_fsdp, expert_fsdp", [
    (4, {"ep_size": 2}, 2, 2),  # no tp: the ep ranks are fsdp ranks, as before tp took part
    (4, {"ep_size": 4}, 4, 1),
    (2, {"ep_size": 2, "tp_size": 2}, 1, 1),  # ep = tp on fsdp 1: the experts split over the tp pair
    (4, {"ep_size": 2, "tp_size": 2}, 1, 2),
    (4, {"ep_size": 4, "tp_size": 2}, 2, 1),  # ep 4 = fsdp 2 × tp 2
    (16, {"ep_size": 4, "tp_size": 2, "cp_size": 2}, 2, 2),
    (4, {"tp_size": 2}, 1, 2),
])
def test_ep_ranks_are_taken_from_fsdp_times_tp(world, sizes, ep_fsdp, expert_fsdp):
    mesh = MeshSpec(**sizes).resolve(world)
    assert (mesh.ep_fsdp_size, mesh.expert_fsdp_size) == (ep_fsdp, expert_fsdp)
    assert mesh.ep_fsdp_size * mesh.expert_fsdp_size == mesh.fsdp_size


@pytest.mark.parametrize("world, sizes, phrase, working", [
    (4, {"ep_size": 3, "tp_size": 2}, "3 is not a multiple of tp_size=2", 2),
    (8, {"ep_size": 2, "tp_size": 4}, "2 is not a multiple of tp_size=4", 4),
    (4, {"ep_size": 8, "tp_size": 2}, "8 does not divide fsdp_size × tp_size = 2×2", 4),
    (6, {"ep_size": 4, "tp_size": 2}, "4 does not divide fsdp_size × tp_size = 3×2", 2),
    (4, {"ep_size": 3}, "3 does not divide fsdp_size × tp_size = 4×1", 2),
])
def test_ep_must_be_a_multiple_of_tp_dividing_fsdp_times_tp(world, sizes, phrase, working):
    with user_error("plan.ep_size", phrase) as info:
        MeshSpec(**sizes).resolve(world)
    assert info.value.message.endswith(f"use e.g. plan.ep_size={working}")
    MeshSpec(**{**sizes, "ep_size": working}).resolve(world)


def test_rank_coordinates_are_outermost_first_with_tp_innermost():
    mesh = MeshSpec(dp_replicate_size=2, fsdp_size=2, sp_size=1, tp_size=2).resolve(8)
    coords = [mesh.coordinates(rank) for rank in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["fsdp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp_replicate"] for c in coords] == [0] * 4 + [1] * 4
    # tp neighbours read the same rows; replicas read different ones
    assert [mesh.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


# ---------------------------------------------------------------- ShardingPlan.validate

def test_default_plan_is_valid():
    ShardingPlan().validate()


def test_validate_cp_and_sp_are_alternatives():
    plan = ShardingPlan(mesh=MeshSpec(cp_size=2, sp_size=2))
    with user_error("plan.cp_size", "alternatives"):
        plan.validate()


@pytest.mark.parametrize("mesh", [MeshSpec(cp_size=2), MeshSpec(sp_size=2)])
def test_validate_allows_cp_or_sp_alone(mesh):
    ShardingPlan(mesh=mesh).validate()


def test_validate_activation_checkpointing_twice():
    plan = ShardingPlan(activation_checkpointing=True)
    plan.validate(model_gradient_checkpointing=False)
    with user_error("plan.activation_checkpointing", "train.gradient_checkpointing"):
        plan.validate(model_gradient_checkpointing=True)


def test_validate_model_gradient_checkpointing_alone_is_fine():
    ShardingPlan(activation_checkpointing=False).validate(model_gradient_checkpointing=True)


@pytest.mark.parametrize("min_num_params", [0, -5])
def test_validate_size_based_wrap_needs_min_num_params(min_num_params):
    plan = ShardingPlan(auto_wrap_policy=WrapPolicy.SIZE_BASED_WRAP, min_num_params=min_num_params)
    with user_error("plan.min_num_params", "SIZE_BASED_WRAP needs a positive min_num_params"):
        plan.validate()


def test_validate_size_based_wrap_with_min_num_params():
    ShardingPlan(auto_wrap_policy=WrapPolicy.SIZE_BASED_WRAP, min_num_params=1000).validate()


@pytest.mark.parametrize("param, reduce, field, bad", [
    ("bf16", "float32", "plan.param_dtype", "bf16"),
    ("float32", "fp64", "plan.reduce_dtype", "fp64"),
    ("float64", "float32", "plan.param_dtype", "float64"),
])
def test_validate_bad_dtypes(param, reduce, field, bad):
    plan = ShardingPlan(mixed_precision=MixedPrecision(param, reduce))
    with user_error(field, f"unknown dtype {bad!r}") as info:
        plan.validate()
    assert "bfloat16" in info.value.message


@pytest.mark.parametrize("dtypes, enabled", [
    (("float32", "float32"), False), (("bfloat16", "float32"), True), (("float32", "float16"), True),
])
def test_mixed_precision_enabled(dtypes, enabled):
    assert MixedPrecision(*dtypes).enabled is enabled


# ---------------------------------------------------------------- wrap_classes

LLAMA_INNER = {
    "LlamaForCausalLM": ("Embedding", "Linear", "LlamaAttention", "LlamaDecoderLayer", "LlamaMLP", "LlamaModel",
                         "LlamaRMSNorm"),
    "LlamaModel": ("Embedding", "Linear", "LlamaAttention", "LlamaDecoderLayer", "LlamaMLP", "LlamaRMSNorm"),
    "LlamaDecoderLayer": ("Linear", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "LlamaAttention": ("Linear",), "LlamaMLP": ("Linear",), "LlamaRMSNorm": (), "Embedding": (), "Linear": (),
}


def model(no_split=("LlamaDecoderLayer",), inner=None, root="LlamaForCausalLM") -> ModelInfo:
    """What describe_model reports, for a Llama by default."""
    inner = LLAMA_INNER if inner is None else inner
    return ModelInfo(class_names=tuple(sorted(inner)), no_split_modules=tuple(no_split), n_params=0, n_layers=0,
                     hidden_size=0, vocab_size=0, root_class=root, inner_classes=inner)


TINY = {"Tiny": ("Linear",), "Linear": ()}


def test_wrap_classes_empty_uses_model_no_split_modules():
    assert ShardingPlan().wrap_classes(model()) == ("LlamaDecoderLayer",)


def test_wrap_classes_plan_overrides_model():
    plan = ShardingPlan(transformer_layer_cls_to_wrap=("LlamaMLP",))
    assert plan.wrap_classes(model()) == ("LlamaMLP",)


def test_wrap_classes_unknown_class_lists_model_layers_no_split_first():
    plan = ShardingPlan(transformer_layer_cls_to_wrap=("GPT2Block",))
    with user_error("plan.transformer_layer_cls_to_wrap", "the model has no class GPT2Block") as info:
        plan.wrap_classes(model())
    assert info.value.message.endswith("classes it has: LlamaDecoderLayer")
    with user_error("plan.transformer_layer_cls_to_wrap", "classes it has: LlamaMLP, LlamaDecoderLayer"):
        plan.wrap_classes(model(no_split=("LlamaMLP",)))


def test_wrap_classes_unknown_class_without_layer_names_lists_all():
    plan = ShardingPlan(transformer_layer_cls_to_wrap=("Block",))
    with user_error("plan.transformer_layer_cls_to_wrap", "classes it has: Linear, Tiny"):
        plan.wrap_classes(model(no_split=(), inner=TINY, root="Tiny"))


def test_wrapping_the_whole_model_is_refused_before_it_fails_in_a_worker():
    plan = ShardingPlan(transformer_layer_cls_to_wrap=("LlamaForCausalLM",))
    with user_error("plan.transformer_layer_cls_to_wrap", (
            "LlamaForCausalLM is the whole model: one unit gathers every parameter at once and saves no memory; "
            "wrap its layers instead (classes it has: LlamaDecoderLayer), or set plan.auto_wrap_policy=NO_WRAP")):
        plan.wrap_classes(model())


def test_a_wrapped_class_inside_another_is_refused():
    plan = ShardingPlan(transformer_layer_cls_to_wrap=("LlamaDecoderLayer", "LlamaMLP"))
    with user_error("plan.transformer_layer_cls_to_wrap", (
            "LlamaDecoderLayer contains LlamaMLP: a unit inside another unit is gathered twice; name one of them "
            "(classes it has: LlamaDecoderLayer")):
        plan.wrap_classes(model())
    siblings = ShardingPlan(transformer_layer_cls_to_wrap=("LlamaAttention", "LlamaMLP"))
    assert siblings.wrap_classes(model()) == ("LlamaAttention", "LlamaMLP")


def test_wrapping_single_layers_runs_with_a_warning_about_communication():
    plan = ShardingPlan(transformer_layer_cls_to_wrap=("Linear",))
    assert plan.wrap_classes(model()) == ("Linear",)
    (warning,) = plan.wrap_warnings(model())
    assert warning.startswith("plan.transformer_layer_cls_to_wrap: Linear holds no other module, so every Linear "
                              "becomes its own FSDP unit")
    assert "more communication than wrapping LlamaDecoderLayer" in warning
    assert ShardingPlan().wrap_warnings(model()) == []
    assert ShardingPlan(auto_wrap_policy=WrapPolicy.NO_WRAP,
                        transformer_layer_cls_to_wrap=("Linear",)).wrap_warnings(model()) == []


def test_wrap_classes_nothing_to_wrap_with_transformer_policy():
    with user_error("plan.transformer_layer_cls_to_wrap", "declares no _no_split_modules") as info:
        ShardingPlan().wrap_classes(model(no_split=(), inner=TINY, root="Tiny"))
    assert "Linear, Tiny" in info.value.message


def test_wrap_classes_nothing_to_wrap_needed_for_activation_checkpointing():
    plan = ShardingPlan(auto_wrap_policy=WrapPolicy.NO_WRAP, activation_checkpointing=True)
    with user_error("plan.transformer_layer_cls_to_wrap", "is empty"):
        plan.wrap_classes(model(no_split=(), inner={"Tiny": ()}, root="Tiny"))


def test_wrap_classes_nothing_to_wrap_is_fine_without_need():
    plan = ShardingPlan(auto_wrap_policy=WrapPolicy.NO_WRAP)
    assert plan.wrap_classes(model(no_split=(), inner={"Tiny": ()}, root="Tiny")) == ()


# ---------------------------------------------------------------- helpers

def test_parse_enum_is_case_insensitive_and_names_choices():
    assert plan_lib.parse_enum(WrapPolicy, "size_based_wrap", "f") is WrapPolicy.SIZE_BASED_WRAP
    with user_error("plan.state_dict_type", "choose one of FULL_STATE_DICT, SHARDED_STATE_DICT"):
        plan_lib.parse_enum(StateDictType, "LOCAL_STATE_DICT", "plan.state_dict_type")


@pytest.mark.parametrize("value, expected", [
    ("", ()), (None, ()), ("A", ("A",)), ("A, B,,", ("A", "B")), (["A", "B"], ("A", "B")), (("A",), ("A",)),
])
def test_as_class_list(value, expected):
    assert plan_lib.as_class_list(value, "f") == expected


@pytest.mark.parametrize("value", [[1, 2], 3, {"A": 1}])
def test_as_class_list_refuses_non_names(value):
    with user_error("plan.transformer_layer_cls_to_wrap", "must be a class name or a list"):
        plan_lib.as_class_list(value, "plan.transformer_layer_cls_to_wrap")


# ---------------------------------------------------------------- validate.resolve_plan / check_train_fields

@pytest.fixture
def config():
    return base_config()


def test_resolve_plan_on_base_config(config):
    plan = validate.resolve_plan(config, 2)
    assert plan.mesh == MeshSpec(fsdp_size=2)
    assert plan.auto_wrap_policy is WrapPolicy.TRANSFORMER_BASED_WRAP
    assert plan.state_dict_type is StateDictType.FULL_STATE_DICT
    assert plan.transformer_layer_cls_to_wrap == ()
    assert plan.xla.xla_fsdp_settings == {}


def test_plan_from_config_maps_fields(config):
    config.plan.transformer_layer_cls_to_wrap = ["LlamaDecoderLayer", "LlamaMLP"]
    config.plan.auto_wrap_policy = "size_based_wrap"
    config.plan.min_num_params = 10
    config.plan.state_dict_type = "sharded_state_dict"
    config.plan.param_dtype = "bfloat16"
    config.plan.reshard_after_forward = False
    config.plan.cpu_offload = True
    config.plan.xla_fsdp_settings = {"compute_dtype": "bfloat16"}
    plan = validate.plan_from_config(config)
    assert plan.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer", "LlamaMLP")
    assert plan.auto_wrap_policy is WrapPolicy.SIZE_BASED_WRAP and plan.min_num_params == 10
    assert plan.state_dict_type is StateDictType.SHARDED_STATE_DICT
    assert plan.mixed_precision == MixedPrecision("bfloat16", "float32")
    assert plan.reshard_after_forward is False and plan.cpu_offload is True
    assert plan.xla.xla_fsdp_settings == {"compute_dtype": "bfloat16"}


def test_resolve_plan_unknown_wrap_policy(config):
    config.plan.auto_wrap_policy = "LAMBDA"
    with user_error("plan.auto_wrap_policy", "unknown value 'LAMBDA'"):
        validate.resolve_plan(config, 1)


def test_lists_and_mappings_keep_their_command_line_spellings(config):
    """Lists are lists and mappings are mappings in the config; the command line still writes them as
    `A,B` and as JSON."""
    apply_override(config, "plan.transformer_layer_cls_to_wrap", "LlamaDecoderLayer, LlamaMLP")
    apply_override(config, "plan.xla_fsdp_settings", '{"compute_dtype": "bfloat16", "shard_param_on_dim_0": true}')
    apply_override(config, "train.freeze", "embed_tokens,norm")
    assert config.plan.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer", "LlamaMLP"]
    assert config.train.freeze == ["embed_tokens", "norm"]
    plan = validate.plan_from_config(config)
    assert plan.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer", "LlamaMLP")
    assert plan.xla.xla_fsdp_settings == {"compute_dtype": "bfloat16", "shard_param_on_dim_0": True}
    apply_override(config, "plan.transformer_layer_cls_to_wrap", "")
    assert validate.plan_from_config(config).transformer_layer_cls_to_wrap == ()


def test_the_config_survives_the_trip_to_a_worker(config):
    """Workers rebuild the config from `to_dict()`: the plan they resolve is the launcher's."""
    apply_override(config, "plan.transformer_layer_cls_to_wrap", "LlamaDecoderLayer")
    apply_override(config, "plan.xla_fsdp_settings", '{"compute_dtype": "bfloat16"}')
    apply_override(config, "plan.tp_plan", '{"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}')
    rebuilt = config_lib.from_dict(config.to_dict())
    assert validate.plan_from_config(rebuilt) == validate.plan_from_config(config)
    assert validate.plan_from_config(rebuilt).tp_plan == {"layers.*.mlp.up_proj": "colwise",
                                                          "layers.*.mlp.down_proj": "rowwise"}


def test_resolve_plan_bad_xla_settings(config):
    with user_error("config.plan.xla_fsdp_settings", "is not a JSON object"):
        apply_override(config, "plan.xla_fsdp_settings", "{nope")
    with user_error("config.plan.xla_fsdp_settings", "must be a JSON object"):
        apply_override(config, "plan.xla_fsdp_settings", "[1]")


def test_every_declared_field_is_in_the_schema_with_its_default(config):
    declared = plan_fields()
    assert sorted(f.name for f in declared) == sorted(config.plan.keys())
    for field in declared:
        assert field.from_config(config.plan[field.name]) == field.value_in(ShardingPlan()), field.name


def test_resolve_plan_runs_plan_validate(config):
    config.plan.activation_checkpointing = True
    config.train.gradient_checkpointing = True
    with user_error("plan.activation_checkpointing", "is on together with train.gradient_checkpointing"):
        validate.resolve_plan(config, 1)


def test_resolve_plan_accepts_context_parallelism(config):
    config.plan.cp_size = 2
    plan = validate.resolve_plan(config, 4)
    assert (plan.mesh.fsdp_size, plan.mesh.cp_size, plan.mesh.data_parallel_size) == (2, 2, 2)


def test_resolve_plan_mesh_mismatch(config):
    config.plan.fsdp_size = 3
    with user_error("plan.fsdp_size", "but the world size is 2"):
        validate.resolve_plan(config, 2)


def test_batch_size_must_split_over_ranks_and_accumulation(config):
    config.train.batch_size = 8
    config.train.grad_accum_steps = 2
    validate.resolve_plan(config, 4)  # 8 = 4 ranks x 2 micro-batches
    with user_error("train.batch_size", "make it a multiple of 12") as info:
        validate.check_train_fields(config, 6)
    assert "6 data-parallel ranks x 2 accumulation steps" in info.value.message
    with user_error("train.batch_size", "make it a multiple of 16"):
        validate.resolve_plan(config, 8)


def test_eval_batch_size_must_split_over_ranks(config):
    config.train.batch_size = 12
    config.train.eval_batch_size = 8
    with user_error("train.eval_batch_size", "make it a multiple of 3"):
        validate.check_train_fields(config, 3)


def test_check_train_fields_accepts_base_config(config):
    validate.check_train_fields(config, 1)
    validate.check_train_fields(config, 8)


def test_seq_len_beyond_max_position_embeddings(config):
    config.data.seq_len = 2048
    with user_error("data.seq_len", "exceeds model.max_position_embeddings=1024"):
        validate.check_train_fields(config, 1)


def test_seq_len_unchecked_against_model_fields_when_init_from(config):
    config.model.init_from = "/some/hf/model"
    config.data.seq_len = 4096
    config.model.num_attention_heads = 3
    validate.check_train_fields(config, 1)


def test_hidden_size_not_divisible_by_heads(config):
    config.model.num_attention_heads = 3
    config.model.num_key_value_heads = 1
    with user_error("model.num_attention_heads", "hidden_size 128 is not divisible by 3 heads"):
        validate.check_train_fields(config, 1)


def test_heads_not_divisible_by_kv_heads(config):
    config.model.num_key_value_heads = 3
    with user_error("model.num_key_value_heads", "4 attention heads are not divisible by 3 kv heads"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "max_position_embeddings"])
def test_model_sizes_must_be_positive(config, field):
    config.model[field] = 0
    with user_error(f"model.{field}", "must be positive (got 0)"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("lr", [0.0, -1e-3])
def test_lr_must_be_positive(config, lr):
    config.train.lr = lr
    with user_error("train.lr", f"must be positive (got {lr})"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("lr", [float("nan"), float("inf")])
def test_lr_must_be_finite(config, lr):
    # `--config.train.lr=nan` parses as a float; a NaN learning rate must not reach the optimizer.
    config.train.lr = lr
    with user_error("train.lr", "must be"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_min_lr_ratio_range(config, ratio):
    config.train.min_lr_ratio = ratio
    with user_error("train.min_lr_ratio", f"must be in [0, 1] (got {ratio})"):
        validate.check_train_fields(config, 1)


def test_unknown_lr_schedule(config):
    config.train.lr_schedule = "polynomial"
    with user_error("train.lr_schedule", "unknown value 'polynomial'; choose one of cosine, linear, constant, wsd"):
        validate.check_train_fields(config, 1)


def test_unknown_optimizer(config):
    config.train.optimizer = "adam"
    with user_error("train.optimizer", "unknown value 'adam'; choose one of adamw, adafactor, lion, sgd"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("field", ["decay_ratio", "momentum"])
def test_wsd_and_sgd_fractions(config, field):
    config.train[field] = 1.5
    with user_error(f"train.{field}", "must be in [0, 1] (got 1.5)"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_min_lr_ratio_bounds_allowed(config, ratio):
    config.train.min_lr_ratio = ratio
    validate.check_train_fields(config, 1)


@pytest.mark.parametrize("name, value", [("beta1", 1.0), ("beta2", -0.5), ("beta2", 1.0)])
def test_betas_range(config, name, value):
    config.train[name] = value
    with user_error(f"train.{name}", f"must be in [0, 1) (got {value})"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("name", ["steps", "batch_size", "grad_accum_steps", "eval_batch_size", "log_every",
                                  "keep_last_n", "collective_timeout_s"])
def test_positive_train_fields(config, name):
    config.train[name] = 0
    with user_error(f"train.{name}", "must be positive (got 0)"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("name", ["eval_every", "save_every", "warmup_steps", "eval_max_batches", "stop_at_step",
                                  "max_grad_norm", "weight_decay", "peak_flops_per_device", "loss_chunk_tokens"])
def test_non_negative_train_fields(config, name):
    config.train[name] = type(config.train[name])(0)
    validate.check_train_fields(config, 1)
    config.train[name] = type(config.train[name])(-1)
    with user_error(f"train.{name}", "must be >= 0 (got -1"):
        validate.check_train_fields(config, 1)


def test_seq_len_must_be_positive(config):
    config.data.seq_len = 0
    with user_error("data.seq_len", "must be positive (got 0)"):
        validate.check_train_fields(config, 1)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.2])
def test_eval_fraction_range(config, fraction):
    config.data.eval_fraction = fraction
    with user_error("data.eval_fraction", f"must be in (0, 1) (got {fraction})"):
        validate.check_train_fields(config, 1)


def test_resolved_plan_is_frozen(config):
    plan = validate.resolve_plan(config, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cpu_offload = True


def test_resolve_plan_unknown_cpu_collectives(config):
    config.plan.cpu_collectives = "mpi"
    with user_error("plan.cpu_collectives", "unknown value 'mpi'; choose one of auto, gloo"):
        validate.resolve_plan(config, 1)
    config.plan.cpu_collectives = "gloo"
    assert validate.resolve_plan(config, 1).cpu_collectives == "gloo"


def test_replicas_inferred_from_the_world_when_fsdp_is_fixed():
    """dp_replicate_size=-1 with fsdp_size=1 is DDP (NO_SHARD): every rank a replica."""
    mesh = MeshSpec(dp_replicate_size=-1, fsdp_size=1, tp_size=2).resolve(8)
    assert (mesh.dp_replicate_size, mesh.fsdp_size, mesh.tp_size) == (4, 1, 2)
    assert MeshSpec(dp_replicate_size=-1, fsdp_size=2).resolve(8).dp_replicate_size == 4


@pytest.mark.parametrize("spec, world, phrase", [
    (MeshSpec(dp_replicate_size=-1), 4, "-1 infers the replicas from the world, which needs a fixed plan.fsdp_size"),
    (MeshSpec(dp_replicate_size=-1, fsdp_size=3), 4, "cannot infer: world size 4 is not divisible by fsdp*cp*sp*tp = 3"),
])
def test_replicas_that_cannot_be_inferred(spec, world, phrase):
    with user_error("plan.dp_replicate_size", phrase):
        spec.resolve(world)
