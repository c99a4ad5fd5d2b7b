"""Read the FSDP settings users already have — a Hugging Face `fsdp_config` JSON or an Accelerate YAML —
into `config.plan`."""
from __future__ import annotations

import json
import pathlib
import warnings

from portable_fsdp.config import set_field
from portable_fsdp.plan import plan_fields
from portable_fsdp.errors import UserError

# fsdp_config key -> config.plan field, from the declarations in plan.py; both spellings (with and without
# "fsdp_") are accepted, as HF does.
PLAN_KEYS = {key: field.name for field in plan_fields() for key in field.hf_keys}
# FSDP1 knobs that FSDP2 does by itself or has no use for: accepted so existing files load, with a warning.
NO_OP_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
              "limit_all_gathers", "sharded_state_dict_type", "offload_params_to_cpu")
SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
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
    apply_fsdp_dict(config, fsdp, path)
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
        if name == "dp_replicate_size":
            if value not in (1, None):
                raise UserError(source, f"= {value}: hybrid sharding (replicated FSDP groups) is not supported; set it to 1")
            continue
        if name == "cp_backend":
            warnings.warn(f"{source} is ignored: plan.cp_impl chooses the context-parallel kernels", stacklevel=2)
            continue
        if name not in PARALLELISM_KEYS:
            raise UserError(source, f"is not a parallelism setting; known: {', '.join(sorted(PARALLELISM_KEYS))}")
        set_field(config, f"plan.{PARALLELISM_KEYS[name]}", value, source)


def apply_fsdp_dict(config, data: dict, path: str) -> None:
    settings = {_strip_prefix(key): value for key, value in data.items()}
    version = settings.pop("version", 2)
    if version not in (1, 2):
        raise UserError(f"{path}: version", f"must be 1 or 2 (got {version!r}); portable_fsdp lowers to FSDP2")
    strategy = settings.pop("sharding_strategy", None)
    if strategy is not None:
        _apply_sharding_strategy(config, strategy, path)
    for key, value in settings.items():
        source = f"{path}: {key}"
        if key in NO_OP_KEYS:
            warnings.warn(f"{source} has no effect with FSDP2 and is ignored", stacklevel=2)
            continue
        if key not in PLAN_KEYS:
            raise UserError(source, f"is not an FSDP setting; known keys: {', '.join(sorted(PLAN_KEYS))}")
        set_field(config, f"plan.{PLAN_KEYS[key]}", _normalise(value), source)


def _strip_prefix(key: str) -> str:
    return key[len("fsdp_"):] if key.startswith("fsdp_") else key


def _apply_sharding_strategy(config, strategy, path: str) -> None:
    name = str(strategy).upper()
    if name not in SHARDING_STRATEGIES:
        raise UserError(f"{path}: sharding_strategy", (
            f"{strategy!r} has no FSDP2 equivalent here; use FULL_SHARD or SHARD_GRAD_OP "
            "(or reshard_after_forward true/false)"))
    set_field(config, "plan.reshard_after_forward", SHARDING_STRATEGIES[name], f"{path}: sharding_strategy")


def _normalise(value):
    """Accelerate writes some booleans as strings ('true'); class lists may be one comma-separated string,
    which config.set_field splits."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
