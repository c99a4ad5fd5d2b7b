"""Read the FSDP settings users already have — a Hugging Face `fsdp_config` JSON or an Accelerate YAML —
into `config.plan`."""
from __future__ import annotations

import json
import pathlib
import warnings

from portable_fsdp.config.schema import set_field
from portable_fsdp.plan import plan_fields
from portable_fsdp.errors import UserError

# fsdp_config key -> config.plan field, from the declarations in plan.py; both spellings (with and without
# "fsdp_") are accepted, as HF does.
PLAN_KEYS = {key: field.name for field in plan_fields() for key in field.hf_keys}
# FSDP1 knobs that FSDP2 does by itself or has no use for: accepted so existing files load, with a warning.
NO_OP_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
              "limit_all_gathers", "sharded_state_dict_type", "offload_params_to_cpu")
# FSDP1's ShardingStrategy, by name or by its number in older files -> FSDP2's reshard_after_forward. The hybrid
# ones also replicate across machines (HSDP: plan.dp_replicate_size = the number of machines).
SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False}
HYBRID_STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
STRATEGIES_WITHOUT_EQUIVALENT = {
    "NO_SHARD": "keeps a whole copy of the model on every rank (DDP); FSDP2 shards: use FULL_SHARD "
                "(reshard_after_forward: true) or SHARD_GRAD_OP (reshard_after_forward: false)",
}
# Hugging Face TrainingArguments' `fsdp` option words (--fsdp "full_shard auto_wrap offload").
FSDP_OPTION_WORDS = {"full_shard": ("plan.reshard_after_forward", True),
                     "shard_grad_op": ("plan.reshard_after_forward", False),
                     "offload": ("plan.cpu_offload", True),
                     "auto_wrap": ("plan.auto_wrap_policy", "TRANSFORMER_BASED_WRAP")}
MIXED_PRECISION = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}


def apply_fsdp_file(config, path: str) -> None:
    """`path` is an fsdp.json, or an Accelerate YAML whose `fsdp_config` section is read."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise UserError("--fsdp_config", f"no such file {path}")
    text = file.read_text()
    if file.suffix in (".yaml", ".yml"):
        apply_accelerate_yaml(config, _load_yaml(text, path), path)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError("--fsdp_config", f"{path} is not valid JSON (line {err.lineno}: {err.msg})") from None
        if not isinstance(data, dict):
            raise UserError("--fsdp_config", f"{path} must hold a JSON object of FSDP settings")
        apply_fsdp_dict(config, data, path)
        apply_hf_xla_path(config, data, path)


def _load_yaml(text: str, path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError("--fsdp_config", f"{path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError("--fsdp_config", f"{path} must hold a YAML mapping (an Accelerate config)")
    return data


def apply_accelerate_yaml(config, data: dict, path: str) -> None:
    fsdp = data.get("fsdp_config")
    if not isinstance(fsdp, dict) or not fsdp:
        raise UserError("--fsdp_config", f"{path} has no fsdp_config section; is it an Accelerate FSDP config?")
    machines = data.get("num_machines", 1)
    apply_fsdp_dict(config, fsdp, path, machines if isinstance(machines, int) and machines > 0 else 1)
    precision = data.get("mixed_precision", "no")
    precision = "no" if precision is False else precision  # YAML reads an unquoted `no` as false
    if precision not in MIXED_PRECISION:
        raise UserError(f"{path}: mixed_precision", f"unknown value {precision!r}; choose one of no, fp16, bf16")
    set_field(config, "plan.param_dtype", MIXED_PRECISION[precision], f"{path}: mixed_precision")
    _apply_parallelism_config(config, data.get("parallelism_config") or {}, path)


# Accelerate's ParallelismConfig keys -> config.plan fields, from the declarations in plan.py (what a backend
# cannot honour is refused later, by name, by the capability table).
PARALLELISM_KEYS = {key: field.name for field in plan_fields() for key in field.accelerate_keys}


def _apply_parallelism_config(config, section: dict, path: str) -> None:
    for key, value in section.items():
        name = key[len("parallelism_config_"):] if key.startswith("parallelism_config_") else key
        source = f"{path}: {key}"
        if name == "cp_backend":
            warnings.warn(f"{source} is ignored: plan.cp_impl chooses the context-parallel kernels", stacklevel=2)
            continue
        if name == "sp_backend":  # Accelerate's Ulysses runs through DeepSpeed; the plan's sp_size is its own
            warnings.warn(f"{source} is ignored: plan.sp_size is lowered by each backend itself, not through "
                          f"{value}", stacklevel=2)
            continue
        if name not in PARALLELISM_KEYS:
            raise UserError(source, f"is not a parallelism setting; known: {', '.join(sorted(PARALLELISM_KEYS))}")
        set_field(config, f"plan.{PARALLELISM_KEYS[name]}", value, source)


def apply_fsdp_dict(config, data: dict, path: str, machines: int = 1) -> None:
    """`machines`: how many machines the run spans, which a hybrid strategy replicates over (HSDP)."""
    settings = {_strip_prefix(key): value for key, value in data.items()}
    version = settings.pop("version", 2)
    if version not in (1, 2):
        raise UserError(f"{path}: version", f"must be 1 or 2 (got {version!r}); portable_fsdp lowers to FSDP2")
    strategy = settings.pop("sharding_strategy", None)
    if strategy is not None:
        _apply_strategy(config, strategy, f"{path}: sharding_strategy", machines)
    for key, value in settings.items():
        source = f"{path}: {key}"
        if key in NO_OP_KEYS:
            warnings.warn(f"{source} has no effect with FSDP2 and is ignored", stacklevel=2)
            continue
        if key not in PLAN_KEYS:
            raise UserError(source, f"is not an FSDP setting; known keys: {', '.join(sorted(PLAN_KEYS))}")
        if key == "reshard_after_forward":  # `accelerate config` for FSDP1 writes a strategy here
            _apply_strategy(config, value, source, machines)
            continue
        set_field(config, f"plan.{PLAN_KEYS[key]}", _normalise(value), source)


def _apply_strategy(config, value, source: str, machines: int) -> None:
    """An FSDP1 strategy (or reshard_after_forward's boolean): a hybrid one shards within each machine and
    replicates across the `machines` (HSDP)."""
    set_field(config, "plan.reshard_after_forward", _normalise(reshard_for_strategy(value, source)), source)
    if not isinstance(value, bool) and strategy_name(value) in HYBRID_STRATEGIES:
        set_field(config, "plan.dp_replicate_size", machines, source)


def strategy_name(value) -> str:
    """An FSDP1 ShardingStrategy as its canonical name, from its name (any case, torch's `_` prefix) or number."""
    return STRATEGY_NUMBERS.get(value, value) if isinstance(value, int) else str(value).upper().lstrip("_")


def reshard_for_strategy(value, source: str):
    """reshard_after_forward from what files write for it: a boolean (or its text), an FSDP1 ShardingStrategy
    name, or that strategy's number (1-5). A strategy FSDP2 has no meaning for is a UserError."""
    if isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false")):
        return value
    name = strategy_name(value)
    if name in SHARDING_STRATEGIES:
        return SHARDING_STRATEGIES[name]
    if name in STRATEGIES_WITHOUT_EQUIVALENT:
        label = f"{value} ({name})" if isinstance(value, int) else name
        raise UserError(source, f"{label} {STRATEGIES_WITHOUT_EQUIVALENT[name]}")
    raise UserError(source, (f"unknown sharding strategy {value!r}; write true/false, FULL_SHARD or SHARD_GRAD_OP "
                             "(FSDP1's 1 and 2)"))


def apply_fsdp_option(config, text: str) -> None:
    """Hugging Face TrainingArguments' `fsdp` string, e.g. "full_shard auto_wrap offload" (--fsdp)."""
    strategies = [word for word in text.split() if word in ("full_shard", "shard_grad_op", "hybrid_shard",
                                                            "hybrid_shard_zero2")]
    if len(strategies) > 1:
        raise UserError("--fsdp", f"names two sharding strategies ({' and '.join(strategies)}); keep one")
    for word in text.split():
        source = f"--fsdp: {word}"
        if word.upper() in STRATEGIES_WITHOUT_EQUIVALENT:
            raise UserError(source, STRATEGIES_WITHOUT_EQUIVALENT[word.upper()])
        if word.upper() in HYBRID_STRATEGIES:  # one machine: the replicas are the machines (1 here)
            _apply_strategy(config, word.upper(), source, 1)
            continue
        if word not in FSDP_OPTION_WORDS:
            words = [*FSDP_OPTION_WORDS, *(name.lower() for name in HYBRID_STRATEGIES)]
            raise UserError(source, f"is not an fsdp option; choose from {', '.join(words)}")
        set_field(config, *FSDP_OPTION_WORDS[word], source)


def apply_hf_xla_path(config, data: dict, path: str) -> None:
    """What Trainer does with a fsdp_config that says `xla: true` (transformers' training_args._process_fsdp_args
    and integrations/tpu.wrap_model_xla_fsdp): torch_xla's FSDP v1 unless the file sets `xla_fsdp_v2` (its
    default is false), and a positive `min_num_params` wraps by size, whatever `auto_wrap_policy` says (that path
    does not read it). Runs after apply_fsdp_dict, on the values it set."""
    keys = {_strip_prefix(key) for key in data}
    if "xla" not in keys or not config.plan.xla:
        return
    if "xla_fsdp_v2" not in keys:
        set_field(config, "plan.xla_fsdp_v2", False, f"{path}: xla")
    if config.plan.min_num_params > 0:
        policy = str(config.plan.auto_wrap_policy).upper()
        if "auto_wrap_policy" in keys and policy != "SIZE_BASED_WRAP":
            warnings.warn(f"{path}: auto_wrap_policy {policy} is not read with xla: true; min_num_params="
                          f"{config.plan.min_num_params} wraps by size, as Hugging Face's XLA FSDP does",
                          stacklevel=3)
        set_field(config, "plan.auto_wrap_policy", "SIZE_BASED_WRAP", f"{path}: min_num_params")


def xla_settings_onto_spmd_plan(config) -> None:
    """Hugging Face's TPU fsdp_config (`xla: true`, `xla_fsdp_settings`, `xla_fsdp_grad_ckpt`) is written for
    torch_xla's FSDP v1. Under SPMD FSDPv2 (plan.xla_fsdp_v2, the xla backend's default) the settings that have
    a plan meaning move onto the plan: `compute_dtype` -> plan.param_dtype, `fp32_reduce_scatter` ->
    plan.reduce_dtype (float32, or the compute dtype): Trainer drops them there, but a run the file asks to compute
    in bfloat16 must not silently train in float32. Any other key is FSDP v1's alone: ignored with one warning, as
    Trainer ignores xla_fsdp_settings under FSDPv2 (portable_fsdp/capabilities.py). A contradiction with a plan
    field the user set is an error naming both."""
    settings = config.plan.xla_fsdp_settings.to_dict()
    if not config.plan.xla_fsdp_v2 or not {"compute_dtype", "fp32_reduce_scatter"} & set(settings):
        return
    field = "plan.xla_fsdp_settings"
    if "compute_dtype" in settings:
        dtype = str(settings.pop("compute_dtype")).removeprefix("torch.")
        if config.plan.param_dtype not in ("float32", dtype):
            raise UserError(field, f"key 'compute_dtype' = {dtype} contradicts plan.param_dtype="
                            f"{config.plan.param_dtype}; set one of them")
        set_field(config, "plan.param_dtype", dtype, f"{field}: compute_dtype")
    if "fp32_reduce_scatter" in settings:
        fp32 = settings.pop("fp32_reduce_scatter")
        if not isinstance(fp32, bool):
            raise UserError(field, f"key 'fp32_reduce_scatter' must be true or false (got {fp32!r})")
        reduce_dtype = "float32" if fp32 else config.plan.param_dtype
        if config.plan.reduce_dtype not in ("float32", reduce_dtype):
            raise UserError(field, f"key 'fp32_reduce_scatter' = {str(fp32).lower()} contradicts plan.reduce_dtype="
                            f"{config.plan.reduce_dtype}; set one of them")
        set_field(config, "plan.reduce_dtype", reduce_dtype, f"{field}: fp32_reduce_scatter")
    set_field(config, field, settings, field)


def _strip_prefix(key: str) -> str:
    return key[len("fsdp_"):] if key.startswith("fsdp_") else key


def _normalise(value):
    """Accelerate writes some booleans as strings ('true'); class lists may be one comma-separated string,
    which config.set_field splits."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
