"""Read the FSDP settings users already have — a Hugging Face `fsdp_config` JSON, an Accelerate YAML, Trainer's
`--fsdp` words, Accelerate's `--parallelism_config_*` launch flags — into `config.plan`, each with the meaning
Hugging Face gives it, or refused in one line saying what to write instead.

Values are read as Hugging Face's parsers read them (Accelerate's str_to_bool: "yes", "1", 1 are true; "2" is the
number 2). Every section and value is type-checked here: a malformed file is one `error:` line."""
from __future__ import annotations

import json
import os
import pathlib

from portable_fsdp.config.schema import set_field
from portable_fsdp.launch import cluster
from portable_fsdp.errors import UserError, notify
from portable_fsdp.plan import plan_fields

# fsdp_config key -> config.plan field, from the declarations in plan.py; both spellings (with and without
# "fsdp_") are accepted, as HF does — the key as written first, so that `fsdp_size` is not read as "size".
PLAN_KEYS = {key: field.name for field in plan_fields() for key in field.hf_keys}
FIELDS = {field.name: field for field in plan_fields()}
# FSDP1 knobs that FSDP2 does by itself or has no use for: accepted so existing files load, with a warning.
NO_OP_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
              "limit_all_gathers", "sharded_state_dict_type", "offload_params_to_cpu")
FSDP1_DIFFERENCES = ("parameters are sharded one by one as DTensors instead of flattened into FlatParameters, so "
                     "use_orig_params has no meaning (the optimizer always sees the original parameters) and "
                     "checkpoints hold per-parameter shards")
# FSDP1's ShardingStrategy, by name or by its number in older files. FULL_SHARD / SHARD_GRAD_OP are FSDP2's
# reshard_after_forward; the hybrid ones also replicate across machines (HSDP); NO_SHARD is DDP: every rank a
# replica, nothing sharded.
SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
                       "NO_SHARD": False}
HYBRID_STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
# Hugging Face TrainingArguments' `fsdp` option words (--fsdp "full_shard auto_wrap offload"); `--fsdp true` is
# fsdp=True (the defaults), `--fsdp false` no FSDP: DDP.
FSDP_OPTION_WORDS = {"offload": ("plan.cpu_offload", True),
                     "auto_wrap": ("plan.auto_wrap_policy", "TRANSFORMER_BASED_WRAP")}
STRATEGY_WORDS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
MIXED_PRECISION = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}
TRUE_WORDS, FALSE_WORDS = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def apply_fsdp_file(config, path: str) -> None:
    """`path` is an fsdp.json, or an Accelerate YAML whose `fsdp_config` section is read."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise UserError("--fsdp_config", f"no such file {path}")
    text = file.read_text()
    if file.suffix in (".yaml", ".yml"):
        apply_accelerate_yaml(config, load_yaml(text, path), path)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError("--fsdp_config", f"{path} is not valid JSON (line {err.lineno}: {err.msg})") from None
        if not isinstance(data, dict):
            raise UserError("--fsdp_config", f"{path} must hold a JSON object of FSDP settings")
        apply_fsdp_dict(config, data, path)
        apply_hf_xla_path(config, data, path)


def load_yaml(text: str, path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError("--fsdp_config", f"{path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError("--fsdp_config", f"{path} must hold a YAML mapping (an Accelerate config)")
    check_keys(data, path)
    return data


def check_keys(section: dict, where: str) -> None:
    """A mapping's keys are names (YAML also reads `1:` or `true:` as keys)."""
    for key in section:
        if not isinstance(key, str):
            raise UserError(where, f"key {key!r} is not a name; keys are setting names such as fsdp_version")


def mapping_section(data: dict, key: str, path: str) -> dict:
    """`data[key]` as a mapping: absent or empty is {}, anything but a mapping is a UserError."""
    section = data.get(key)
    if section in (None, "", [], {}):
        return {}
    if not isinstance(section, dict):
        raise UserError(f"{path}: {key}", f"must be a mapping of settings (got {section!r})")
    check_keys(section, f"{path}: {key}")
    return section


def apply_accelerate_yaml(config, data: dict, path: str) -> None:
    fsdp = mapping_section(data, "fsdp_config", path)
    if not fsdp:
        raise UserError("--fsdp_config", f"{path} has no fsdp_config section; is it an Accelerate FSDP config?")
    machines = data.get("num_machines")
    apply_fsdp_dict(config, fsdp, path, machines if isinstance(machines, int) and machines > 0 else None)
    precision = data.get("mixed_precision", "no")
    precision = "no" if precision is False else precision  # YAML reads an unquoted `no` as false
    if not isinstance(precision, str) or precision not in MIXED_PRECISION:
        raise UserError(f"{path}: mixed_precision", f"unknown value {precision!r}; choose one of no, fp16, bf16")
    set_field(config, "plan.param_dtype", MIXED_PRECISION[precision], f"{path}: mixed_precision")
    section = mapping_section(data, "parallelism_config", path)
    wanted = data.get("use_parallelism_config", True)
    if section and as_bool(wanted, f"{path}: use_parallelism_config") is False:
        notify(f"{path}: parallelism_config is ignored: use_parallelism_config is false")
        return
    apply_parallelism_config(config, section, f"{path}: ")


# Accelerate's ParallelismConfig keys -> config.plan fields, from the declarations in plan.py (what a backend
# cannot honour is refused later, by name, by the capability table).
PARALLELISM_KEYS = {key: field.name for field in plan_fields() for key in field.accelerate_keys}
# Accelerate's ParallelismConfig settings with no plan field: why each is ignored (None: accepted silently at the
# value given; they ask for nothing here).
PARALLELISM_IGNORED = {
    "cp_backend": ("torch", "plan.cp_impl chooses the context-parallel kernels"),
    "sp_backend": (None, "plan.sp_size is lowered by each backend itself, not through DeepSpeed"),
    "sp_attn_implementation": ("sdpa", "attention runs as model.attn_implementation says"),
    "sp_seq_length_is_variable": (None, None),
}


def apply_parallelism_config(config, section: dict, prefix: str) -> None:
    """Accelerate's `parallelism_config` (a YAML section, or the `--parallelism_config_*` flags as text) onto
    the plan; `prefix` + a key names where a value came from. Sizes left unset are inferred from the world
    (fsdp) or stay 1."""
    settings = {key.removeprefix("parallelism_config_"): (f"{prefix}{key}", value) for key, value in section.items()}
    variable = as_bool(*settings.get("sp_seq_length_is_variable", ("", True))[::-1])
    for name, (where, value) in settings.items():
        if name == "sp_seq_length":
            _check_sp_seq_length(config, value, variable, where)
        elif name in PARALLELISM_IGNORED:
            asks_nothing, why = PARALLELISM_IGNORED[name]
            if why and str(value) != str(asks_nothing):
                notify(f"{where} is ignored: {why}")
        elif name in PARALLELISM_KEYS:
            set_plan_field(config, PARALLELISM_KEYS[name], value, where)
        else:
            known = sorted([*PARALLELISM_KEYS, *PARALLELISM_IGNORED, "sp_seq_length"])
            raise UserError(where, f"is not a parallelism setting; known: {', '.join(known)}")


def _check_sp_seq_length(config, value, variable: bool, where: str) -> None:
    """Accelerate's fixed Ulysses length: batches here always have data.seq_len tokens, so a fixed length must
    be that one; a variable one asks nothing."""
    if value in (None, "None") or variable:
        return
    length = as_int(value, where)
    if length != config.data.seq_len:
        raise UserError(where, f"{length} is not the length of every batch here, data.seq_len={config.data.seq_len}; "
                        f"set data.seq_len={length} or drop the setting")


def apply_fsdp_dict(config, data: dict, path: str, machines: int | None = None) -> None:
    """`machines`: how many machines the run spans, which a hybrid strategy replicates over (HSDP); None = the
    machines the launcher reports (torchrun, SLURM), else one."""
    check_keys(data, path)
    settings = {}
    for key, value in data.items():
        settings[key if key in PLAN_KEYS else _strip_prefix(key)] = value
    _check_version(settings.pop("version", 2), f"{path}: version")
    strategy = settings.pop("sharding_strategy", None)
    if strategy is not None:
        _apply_strategy(config, strategy, f"{path}: sharding_strategy", machines)
    for key, value in settings.items():
        source = f"{path}: {key}"
        if key in NO_OP_KEYS:
            notify(f"{source} has no effect with FSDP2 and is ignored")
            continue
        if key not in PLAN_KEYS:
            raise UserError(source, f"is not an FSDP setting; known keys: {', '.join(sorted(PLAN_KEYS))}")
        if key == "reshard_after_forward":  # `accelerate config` for FSDP1 writes a strategy here
            _apply_strategy(config, value, source, machines)
            continue
        set_plan_field(config, PLAN_KEYS[key], value, source)


def _check_version(value, source: str) -> None:
    """1 or 2 (or their text). FSDP1 runs as FSDP2, as Hugging Face will: one line says what differs."""
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    version = int(text) if text.isdigit() else None
    if version not in (1, 2):
        raise UserError(source, f"must be 1 or 2 (got {value!r}); portable_fsdp lowers to FSDP2")
    if version == 1:
        notify(f"{source}: FSDP1 runs as FSDP2 here: {FSDP1_DIFFERENCES}; write version 2 to silence this")


def set_plan_field(config, name: str, value, source: str) -> None:
    """Set config.plan.<name> from a file's value, read as Hugging Face's parsers read it for the field's type."""
    default = FIELDS[name].config_default
    if isinstance(default, bool):
        value = as_bool(value, source)
    elif isinstance(default, int) and isinstance(value, str):
        value = as_int(value, source)
    set_field(config, f"plan.{name}", value, source)


def as_bool(value, source: str) -> bool:
    """Accelerate's str_to_bool: true/false, yes/no, on/off, y/n, t/f, 1/0 (as text or numbers)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in TRUE_WORDS or text in FALSE_WORDS:
        return text in TRUE_WORDS
    raise UserError(source, f"must be true or false (got {value!r})")


def as_int(value, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise UserError(source, f"must be an integer (got {value!r})") from None


def _apply_strategy(config, value, source: str, machines: int | None) -> None:
    """reshard_after_forward from what files write for it: a boolean (or its text), or an FSDP1 ShardingStrategy
    by name or number (1-5). A hybrid strategy shards within each machine and replicates across the machines
    (HSDP); NO_SHARD replicates over every rank (DDP)."""
    name = strategy_name(value)
    if name is None:
        set_field(config, "plan.reshard_after_forward", as_bool(value, source), source)
        return
    if name not in SHARDING_STRATEGIES:
        raise UserError(source, (f"unknown sharding strategy {value!r}; write true/false, FULL_SHARD, SHARD_GRAD_OP, "
                                 "HYBRID_SHARD, HYBRID_SHARD_ZERO2 or NO_SHARD (FSDP1's 1-5)"))
    set_field(config, "plan.reshard_after_forward", SHARDING_STRATEGIES[name], source)
    if name in HYBRID_STRATEGIES:
        replicate_across_machines(config, source, machines)
    elif name == "NO_SHARD":
        replicate_everywhere(config, source)


def strategy_name(value) -> str | None:
    """An FSDP1 ShardingStrategy's canonical name from its name (any case, torch's `_` prefix) or number (as a
    number or text); None for a boolean (true/false, yes/no, 0, ...)."""
    text = str(value).strip()
    if isinstance(value, bool) or (not text.isdigit() and text.lower() in (*TRUE_WORDS, *FALSE_WORDS)) or text == "0":
        return None
    if text.isdigit():
        return STRATEGY_NUMBERS.get(int(text), text)
    return text.upper().lstrip("_")


def replicate_across_machines(config, source: str, machines: int | None) -> None:
    """HSDP over the machines the launcher reports (torchrun, SLURM), else the file's num_machines."""
    count, reported_by = cluster.machines_reported(os.environ) or ((machines, "num_machines") if machines else
                                                                  (1, "this launcher"))
    if count == 1:
        notify(f"{source}: a hybrid strategy replicates across machines and {reported_by} reports one, so it "
               "shards over every rank as FULL_SHARD does; run on several machines, or set plan.dp_replicate_size")
    set_field(config, "plan.dp_replicate_size", count, source)


def replicate_everywhere(config, source: str) -> None:
    """DDP: every rank a replica of the whole model (plan.dp_replicate_size takes the world, fsdp 1)."""
    set_field(config, "plan.fsdp_size", 1, source)
    set_field(config, "plan.dp_replicate_size", -1, source)


def apply_fsdp_option(config, option) -> None:
    """Hugging Face TrainingArguments' `fsdp`: its words ("full_shard auto_wrap offload", --fsdp), a list of
    them, or a boolean (true: FSDP with the defaults; false: no FSDP, so DDP)."""
    words = option.split() if isinstance(option, str) else list(option) if isinstance(option, (list, tuple)) else None
    if not isinstance(option, bool) and (not words or not all(isinstance(word, str) for word in words)):
        raise UserError("--fsdp", f"must be option words such as 'full_shard auto_wrap', or true (got {option!r})")
    if isinstance(option, bool) or (len(words) == 1 and strategy_name(words[0]) is None):
        if not as_bool(option, "--fsdp"):
            replicate_everywhere(config, "--fsdp")
            set_field(config, "plan.reshard_after_forward", False, "--fsdp")
        return
    strategies = [word for word in words if word in STRATEGY_WORDS]
    if len(strategies) > 1:
        raise UserError("--fsdp", f"names two sharding strategies ({' and '.join(strategies)}); keep one")
    for word in words:
        source = f"--fsdp: {word}"
        if word in STRATEGY_WORDS:
            _apply_strategy(config, word.upper(), source, None)
        elif word in FSDP_OPTION_WORDS:
            set_field(config, *FSDP_OPTION_WORDS[word], source)
        else:
            raise UserError(source, f"is not an fsdp option; choose from {', '.join([*STRATEGY_WORDS, *FSDP_OPTION_WORDS])}")


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
            notify(f"{path}: auto_wrap_policy {policy} is not read with xla: true; min_num_params="
                   f"{config.plan.min_num_params} wraps by size, as Hugging Face's XLA FSDP does")
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
