"""The capability table: what each backend does with each setting, checked once at start-up
(portable_fsdp/capabilities.py, validate.check_backend). Every refusal and every "no effect" warning it can
give is exercised here, without starting a framework."""
import re
import warnings

import pytest

from portable_fsdp import capabilities
from portable_fsdp.config.schema import apply_override, base_config, flat_fields, load_recipe
from portable_fsdp.config.validate import check_backend, resolve_plan
from tests.conftest import ROOT, TEST_RECIPE
from tests.unit._helpers import user_error


def check(backend, overrides=(), device=None, nproc=2):
    """check_backend on the test recipe with `overrides`; returns the warnings' messages."""
    config = load_recipe(TEST_RECIPE)
    for key, value in dict(overrides).items():
        apply_override(config, key, value)
    plan = resolve_plan(config, nproc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_backend(config, plan, backend, device or backend, nproc)
    return [str(w.message) for w in caught]


# (backend, overrides, device, nproc, field named, a phrase of the fix)
REFUSED = [
    ("xla", {"plan.tp_size": "2", "plan.xla_fsdp_v2": "false"}, "CPU", 2, "plan.tp_size", "cannot split layers; use SPMD FSDPv2 (plan.xla_fsdp_v2=true)"),
    ("xla", {"plan.ep_size": "2", "plan.xla_fsdp_v2": "false"}, "CPU", 2, "plan.ep_size", "cannot split experts"),
    ("xla", {"plan.sp_size": "2", "plan.xla_fsdp_v2": "false"}, "CPU", 2, "plan.sp_size", "or set plan.sp_size=1"),
    ("xla", {"plan.dp_replicate_size": "2", "plan.xla_fsdp_v2": "false"}, "CPU", 2, "plan.dp_replicate_size", "cannot replicate shards"),
    ("cpu", {"plan.cp_size": "2", "plan.cp_impl": "torch"}, None, 2, "plan.cp_impl", "cannot run on cpu; use plan.cp_impl=portable"),
    ("xla", {"plan.cp_size": "2", "plan.cp_impl": "torch"}, "CPU", 2, "plan.cp_impl", "use plan.cp_impl=auto"),
    ("xla", {"plan.cp_size": "2", "plan.xla_fsdp_v2": "false"}, "TPU", 2, "plan.cp_size", "cannot split sequences"),
    ("cuda", {"plan.cp_size": "2", "plan.cp_load_balance": "false"}, None, 2, "plan.cp_load_balance", "set plan.cp_impl=portable"),
    ("cuda", {"plan.cp_size": "2", "data.document_masking": "true"}, None, 2, "data.document_masking", "use plan.cp_impl=portable"),
    ("cpu", {"plan.sp_size": "2", "model.attn_implementation": "flash_attention_2"}, None, 2,
     "model.attn_implementation", "flash_attention_2: Ulysses sequence parallelism on --backend cpu runs the model's "
     "sdpa or eager attention over the whole sequence on each rank's heads; set model.attn_implementation=sdpa"),
    ("xla", {"plan.cpu_offload": "true"}, "CPU", 2, "plan.cpu_offload", "set plan.cpu_offload=false"),
    ("flax", {"plan.cpu_offload": "true"}, "tpu", 2, "plan.cpu_offload", "with tpu devices; set it to false"),
    ("xla", {"plan.reshard_after_forward": "false"}, "CPU", 2, "plan.reshard_after_forward", "plan.xla_fsdp_v2=false"),
    ("xla", {"plan.cpu_ram_efficient_loading": "true", "plan.xla_fsdp_v2": "false"}, "TPU", 4, "plan.cpu_ram_efficient_loading", "plan.xla_fsdp_v2=true"),
    ("xla", {"plan.param_dtype": "float16"}, "CPU", 2, "plan.param_dtype", "use bfloat16"),
    ("xla", {"plan.param_dtype": "bfloat16"}, "CPU", 2, "plan.param_dtype", "model.attn_implementation=eager"),
    ("xla", {"plan.param_dtype": "bfloat16", "plan.reduce_dtype": "bfloat16"}, "CPU", 2, "plan.reduce_dtype", "set plan.reduce_dtype=float32"),
    ("xla", {"plan.param_dtype": "bfloat16", "plan.reduce_dtype": "float16", "plan.xla_fsdp_v2": "false"}, "TPU", 4,
     "plan.reduce_dtype", "float16 with plan.param_dtype=bfloat16: XlaFullyShardedDataParallel reduces gradients in the "
     "compute dtype or in float32 (fp32_reduce_scatter); set plan.reduce_dtype=float32 or plan.reduce_dtype=bfloat16"),
    ("xla", {"plan.xla_fsdp_v2": "false"}, "CUDA", 1, "plan.xla_fsdp_v2", "launched on CPU and TPU only, not on PJRT device cuda"),
    ("xla", {"plan.xla_fsdp_v2": "false"}, "CPU", 2, "--nproc", "2: FSDP v1 (plan.xla_fsdp_v2=false) runs one process per device"),
    ("flax", {"train.freeze": "embed_tokens"}, "cpu", 2, "train.freeze", "leave train.freeze empty"),
    ("cpu", {"plan.compile": "true", "plan.cp_size": "2"}, None, 2, "plan.compile",
     "with plan.cp_size=2: the context-parallel attention reads each batch's shard layout from a context variable, "
     "which torch.compile cannot trace inside a layer compiled whole; set plan.compile=false or plan.cp_size=1"),
    ("cuda", {"plan.compile": "true", "plan.cp_size": "2", "plan.cp_impl": "portable"}, None, 2, "plan.compile",
     "from a context variable"),
    ("cuda", {"plan.compile": "true", "plan.cp_size": "2"}, None, 2, "plan.compile",
     "under torch's context_parallel (plan.cp_impl=auto takes it on CUDA"),
    ("cpu", {"plan.compile": "true", "plan.sp_size": "2"}, None, 2, "plan.compile",
     "the Ulysses sequence-parallel attention reads"),
    ("cuda", {"plan.compile": "true", "plan.sp_size": "2"}, None, 2, "plan.compile", "or plan.sp_size=1"),
    ("cpu", {"plan.compile": "true", "plan.ep_size": "2"}, None, 2, "plan.compile",
     "with plan.ep_size=2: each layer's experts are an FSDP unit of their own inside the layer"),
    ("cuda", {"plan.compile": "true", "plan.auto_wrap_policy": "SIZE_BASED_WRAP", "plan.min_num_params": "1000"},
     None, 2, "plan.compile", "use plan.auto_wrap_policy=TRANSFORMER_BASED_WRAP or set plan.compile=false"),
    ("cpu", {"plan.float8": "true"}, None, 2, "plan.float8", "on a CPU they are emulated, slower than float32"),
    ("xla", {"plan.float8": "true"}, "TPU", 2, "plan.float8", "which torch_xla does not run"),
    ("flax", {"plan.float8": "true"}, "gpu", 2, "plan.float8", "--backend flax has no float8 matmuls"),
    ("cuda", {"plan.float8": "true", "plan.compile": "true", "plan.tp_size": "2"}, None, 2, "plan.float8",
     "with plan.tp_size=2: tensor-parallel float8 layers need torchao's float8 tensor-parallel styles"),
    ("xla", {"model.peft.type": "lora"}, "CPU", 2, "model.peft.type",
     "= lora: adapters are trained by --backend cpu or cuda only; use one of them, or leave model.peft.type empty"),
    ("flax", {"model.peft.type": "lora"}, "cpu", 2, "model.peft.type", "adapters are trained by --backend cpu or cuda"),
    ("cpu", {"model.peft.type": "lora", "plan.tp_size": "2"}, None, 2, "model.peft.type",
     "= lora with plan.tp_size=2: torch's tensor-parallel styles split plain Linear layers, not peft's adapted ones"),
    ("cuda", {"model.peft.type": "lora", "plan.float8": "true", "plan.compile": "true"}, None, 2, "model.peft.type",
     "the float8 conversion does not look inside peft's adapted layers; set plan.float8=false"),
]


@pytest.mark.parametrize("backend, overrides, device, nproc, field, fix", REFUSED,
                         ids=[f"{c[0]}-{c[4]}" for c in REFUSED])
def test_refused_settings_name_the_field_and_the_fix(backend, overrides, device, nproc, field, fix):
    with user_error(field, fix):
        check(backend, overrides, device, nproc)


# (backend, overrides, device, the fields warned about)
WITHOUT_EFFECT = [
    ("cuda", {"plan.cpu_collectives": "gloo"}, None, ["plan.cpu_collectives"]),
    ("xla", {"plan.cpu_collectives": "gloo"}, "CPU", ["plan.cpu_collectives"]),
    ("xla", {"plan.cp_size": "2", "plan.cp_rotate_method": "alltoall", "plan.cp_load_balance": "false"}, "CPU",
     ["plan.cp_load_balance", "plan.cp_rotate_method"]),
    ("flax", {"plan.reshard_after_forward": "false", "plan.auto_wrap_policy": "NO_WRAP",
              "plan.cpu_ram_efficient_loading": "true", "plan.reduce_dtype": "bfloat16",
              "plan.cpu_collectives": "gloo"}, "cpu",
     ["plan.reshard_after_forward", "plan.auto_wrap_policy", "plan.cpu_ram_efficient_loading", "plan.reduce_dtype",
      "plan.cpu_collectives"]),
    ("cpu", {"plan.xla": "true", "plan.xla_fsdp_settings": '{"compute_dtype": "bfloat16"}', "plan.xla_fsdp_v2": "false"},
     None, ["plan.xla", "plan.xla_fsdp_settings", "plan.xla_fsdp_v2"]),
    ("flax", {"plan.cpu_offload": "true"}, "cpu", []),  # host memory already: honoured by construction
    ("flax", {"plan.state_dict_type": "SHARDED_STATE_DICT", "train.async_save": "true"}, "cpu", []),  # orbax
    ("cpu", {"plan.min_num_params": "1000"}, None, ["plan.min_num_params"]),  # read by SIZE_BASED_WRAP only
    ("xla", {"plan.min_num_params": "1000", "plan.auto_wrap_policy": "SIZE_BASED_WRAP"}, "CPU", []),
    ("cpu", {"plan.cp_size": "2", "plan.cp_rotate_method": "alltoall", "plan.cp_load_balance": "false"}, None, []),
    ("cpu", {"plan.cpu_collectives": "gloo", "plan.cpu_offload": "true"}, None, []),
    ("xla", {"plan.compile": "true"}, "TPU", ["plan.compile"]),  # XLA compiles every step anyway
    ("flax", {"plan.compile": "true"}, "cpu", ["plan.compile"]),  # and so does jax.jit
    ("cpu", {"plan.compile": "true", "plan.tp_size": "2", "plan.activation_checkpointing": "true"}, None, []),
    ("cuda", {"plan.compile": "true", "plan.float8": "true", "plan.activation_checkpointing": "true"}, None, []),
    ("cpu", {"plan.compile": "true", "plan.cpu_offload": "true"}, None, []),
    ("cuda", {"model.peft.type": "lora"}, None, []),
]


@pytest.mark.parametrize("backend, overrides, device, fields", WITHOUT_EFFECT,
                         ids=[f"{c[0]}-{'-'.join(c[3]) or 'honoured'}" for c in WITHOUT_EFFECT])
def test_settings_without_effect_are_one_warning_each(backend, overrides, device, fields):
    messages = check(backend, overrides, device)
    assert [m.split(" ")[0] for m in messages] == fields, messages
    assert all(f" has no effect on --backend {backend}: " in m for m in messages), messages


@pytest.mark.parametrize("backend, device", [("cpu", None), ("cuda", None), ("xla", "CPU"), ("xla", "TPU")])
def test_no_wrap_runs_with_a_warning_that_it_saves_no_memory(backend, device):
    overrides = {"plan.auto_wrap_policy": "NO_WRAP"}
    if device == "TPU":
        overrides["plan.xla_fsdp_v2"] = "false"
    (message,) = check(backend, overrides, device, nproc=1 if device == "TPU" else 2)
    assert message == ("plan.auto_wrap_policy=NO_WRAP: the whole model is one FSDP unit, so every parameter is "
                       "gathered at once and sharding saves no memory at compute time")


def test_float8_without_compiled_layers_runs_with_a_warning_about_its_casts():
    (message,) = check("cuda", {"plan.float8": "true"})
    assert message == ("plan.float8=true: without plan.compile every float8 cast is a kernel of its own, which "
                       "usually makes the layers slower than in bfloat16; set plan.compile=true")


@pytest.mark.parametrize("backend, device", [("cpu", None), ("cuda", None), ("xla", "CPU"), ("flax", "cpu")])
def test_the_default_config_is_honoured_everywhere(backend, device):
    assert check(backend, device=device) == []


def test_every_rule_reads_fields_of_the_schema_and_names_known_targets():
    fields = set(flat_fields(base_config())) | {f"model.{name}" for name in capabilities.MODEL_FIELDS}  # the model's own
    for rule in capabilities.RULES:
        assert rule.field in fields | {"--nproc"}, rule.field
        assert {name for name, _ in rule.when} <= fields | {"device", "--nproc"}, rule
        assert set(rule.verdicts) <= set(capabilities.TARGETS), rule
        for verdict in rule.verdicts.values():
            text = verdict.fix if isinstance(verdict, capabilities.Refused) else verdict.why
            assert not re.search(r"\bissue|not built|yet\b", text), text


def test_docs_table_is_generated_from_the_rules():
    assert (ROOT / "docs" / "capabilities.md").read_text() == capabilities.markdown(), (
        "docs/capabilities.md is stale: python -m portable_fsdp.capabilities > docs/capabilities.md")


def test_readme_plan_table_lists_every_plan_field_and_links_the_capabilities():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### The plan"):]
    table = table[:table.index("\n\n", table.index("| field |"))]
    for field in base_config().plan:
        assert f"plan.{field}" in table, f"README's plan table does not list plan.{field}"
    assert "docs/capabilities.md" in readme


def test_the_python_api_checks_the_backend_as_the_command_does():
    from portable_fsdp import api

    config = api.get_config(TEST_RECIPE, {"train.freeze": "embed_tokens"})
    with user_error("train.freeze", "leave train.freeze empty"):
        api.plan_for(config, 2, backend="flax")
    assert api.plan_for(config, 2, backend="cpu").mesh.fsdp_size == 2
    assert api.plan_for(config, 2).mesh.fsdp_size == 2  # without a backend: the backend-free checks only


@pytest.mark.parametrize("written", ["full_state_dict", "Full_State_Dict", "FULL_STATE_DICT"])
def test_the_table_reads_enum_fields_as_the_plan_does_whatever_their_case(written):
    with user_error("train.async_save", "set plan.state_dict_type=SHARDED_STATE_DICT"):
        check("flax", {"plan.state_dict_type": written, "train.async_save": "true"}, "cpu")
    assert check("flax", {"plan.auto_wrap_policy": "transformer_based_wrap"}, "cpu") == []


@pytest.mark.parametrize("backend, overrides, device, nproc", [
    ("xla", {"plan.xla_fsdp_v2": "false"}, "TPU", 4),  # FSDP v1's defaults on a TPU pod
    ("xla", {"plan.cp_size": "2"}, "CPU", 2),  # sequence sharding alone: nothing to warn about
    ("cpu", {"plan.cp_size": "2"}, None, 2),
])
def test_plain_settings_pass_without_a_word(backend, overrides, device, nproc):
    assert check(backend, overrides, device, nproc) == []


def test_every_default_variant_of_the_test_matrix_is_honoured():
    """A new rule must not silently drop a variant from a backend's default parity tests."""
    from tests.parity import matrix

    for backend, names in matrix.DEFAULT.items():
        assert [n for n in names if not matrix.honours(backend, n)] == [], backend
