"""The config schema (an ml_collections ConfigDict), recipe loading and `--config.a.b=value` overrides.

`base_config()` is the schema: every field a run understands, with its default and type. Recipes in
`configs/` start from it and change values; the command line may change any field but add none.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import math
import pathlib

import ml_collections

from portable_fsdp.errors import UserError

DEFAULT_RECIPE = "llama_tiny"


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.init_from = ""  # a local Hugging Face model directory; empty = random init from the fields below
    c.model.vocab_size = 384
    c.model.hidden_size = 128
    c.model.intermediate_size = 352
    c.model.num_hidden_layers = 4
    c.model.num_attention_heads = 4
    c.model.num_key_value_heads = 2
    c.model.max_position_embeddings = 1024
    c.model.rope_theta = 10000.0
    c.model.rms_norm_eps = 1e-6
    c.model.tie_word_embeddings = False
    c.model.initializer_range = 0.02
    c.model.attn_implementation = "sdpa"

    c.data = ml_collections.ConfigDict()
    c.data.source = "bundled"  # "bundled", a local text file, or a local `datasets` file / saved directory
    c.data.text_column = "text"
    c.data.tokenizer = "byte"  # "byte" or a local tokenizer directory (AutoTokenizer.from_pretrained)
    c.data.seq_len = 128
    c.data.eval_fraction = 0.05
    c.data.document_masking = False  # packed documents attend only within themselves (position ids restart)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 300
    c.train.batch_size = 8  # global sequences per optimizer step
    c.train.grad_accum_steps = 1
    c.train.eval_batch_size = 8  # global sequences per eval step
    c.train.eval_every = 100
    c.train.eval_max_batches = 0  # 0 = the whole eval split
    c.train.compute_metrics = ""  # "", "token_accuracy" or "package.module:function(predictions, labels) -> dict"
    c.train.early_stopping_patience = 0  # stop after this many evals without a better eval_loss; 0 = never
    c.train.load_best_model_at_end = False  # end with the weights of the best eval_loss (kept on disk as `best`)
    c.train.log_every = 10
    c.train.save_every = 0  # 0 = only at the end
    c.train.keep_last_n = 2
    c.train.resume = False
    c.train.save_on_interrupt = True  # on SIGINT/SIGTERM: finish the step, save a checkpoint, exit 130
    c.train.stop_at_step = 0  # end this run (with a checkpoint) after that step; resume later. 0 = run to train.steps
    c.train.lr = 3e-3
    c.train.min_lr_ratio = 0.1
    c.train.warmup_steps = 20
    c.train.weight_decay = 0.1
    c.train.beta1 = 0.9
    c.train.beta2 = 0.95
    c.train.eps = 1e-8
    c.train.max_grad_norm = 1.0  # 0 = no clipping
    c.train.nonfinite = "stop"  # a NaN/inf loss or gradient: "stop" (error naming the step) or "skip" the update
    c.train.freeze = ""  # comma-separated regexes of parameter names to keep frozen (e.g. "embed_tokens")
    c.train.gradient_checkpointing = False  # the model's own; prefer plan.activation_checkpointing
    c.train.peak_flops_per_device = 0.0  # for MFU; 0 = measure a matmul (CPU) or look up the GPU
    c.train.progress_bar = True
    c.train.collective_timeout_s = 300

    c.plan = ml_collections.ConfigDict()
    c.plan.fsdp_size = -1
    c.plan.cp_size = 1
    c.plan.tp_size = 1
    c.plan.ep_size = 1
    c.plan.sp_size = 1
    c.plan.cp_rotate_method = "allgather"  # allgather | alltoall
    c.plan.cp_impl = "auto"  # auto | torch | portable
    c.plan.cp_load_balance = True  # head-tail split; false = contiguous
    c.plan.cpu_collectives = "auto"  # FSDP's collectives between CPU ranks: auto (shared memory on one host) | gloo
    c.plan.reshard_after_forward = True
    c.plan.cpu_offload = False
    c.plan.auto_wrap_policy = "TRANSFORMER_BASED_WRAP"
    c.plan.transformer_layer_cls_to_wrap = ""  # comma-separated; empty = the model's _no_split_modules
    c.plan.min_num_params = 0
    c.plan.state_dict_type = "FULL_STATE_DICT"
    c.plan.cpu_ram_efficient_loading = False
    c.plan.activation_checkpointing = False
    c.plan.param_dtype = "float32"
    c.plan.reduce_dtype = "float32"
    c.plan.xla = False
    c.plan.xla_fsdp_settings = "{}"  # JSON object, passed to torch_xla by the xla backend
    c.plan.xla_fsdp_grad_ckpt = False
    c.plan.xla_fsdp_v2 = True  # xla backend: SPMD FSDPv2 (one process per host); false = FSDP v1 (one per device)
    return c


def load_recipe(spec: str | None) -> ml_collections.ConfigDict:
    """`path/to/recipe.py[:arg]` (or a bundled recipe name) -> the ConfigDict its get_config(arg) returns."""
    spec = spec or DEFAULT_RECIPE
    path, _, arg = spec.partition(":")
    module = _import_recipe(path)
    if not hasattr(module, "get_config"):
        raise UserError("--config", f"{path} defines no get_config(arg) function")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except (ValueError, TypeError, KeyError) as err:
        raise UserError("--config", f"{path}: get_config({arg!r}) failed: {err}") from None
    _check_same_schema(config, base_config(), "")
    config.lock()
    return config


def _import_recipe(path: str):
    file = pathlib.Path(path)
    if file.suffix == ".py":
        if not file.is_file():
            raise UserError("--config", f"no such recipe file {path}; give a path like configs/llama_tiny.py")
        spec = importlib.util.spec_from_file_location(f"portable_fsdp_recipe_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(f"portable_fsdp.configs.{path}")
    except ModuleNotFoundError:
        raise UserError("--config", f"no bundled recipe {path!r}; give a .py file such as configs/llama_tiny.py") from None


def _check_same_schema(config, schema, prefix: str) -> None:
    for key in config.keys():
        if key not in schema:
            raise UserError(f"config.{prefix}{key}", "is not a field of the schema (portable_fsdp/config.py)")
        if isinstance(schema[key], ml_collections.ConfigDict):
            _check_same_schema(config[key], schema[key], f"{prefix}{key}.")


def apply_override(config: ml_collections.ConfigDict, dotted: str, raw: str) -> None:
    """Set `config.<dotted>` from its command-line text, typed by the field's current value."""
    *parents, leaf = dotted.split(".")
    node = config
    for depth, name in enumerate(parents):
        if name in node and not isinstance(node[name], ml_collections.ConfigDict):
            section = ".".join(parents[: depth + 1])
            raise UserError(f"config.{dotted}", f"config.{section} is a value, not a section; set --config.{section}=...")
        if name not in node:
            _unknown(config, dotted)
        node = node[name]
    if leaf not in node:
        _unknown(config, dotted)
    if isinstance(node[leaf], ml_collections.ConfigDict):
        raise UserError(f"config.{dotted}", "is a section; set one of its fields, e.g. "
                        f"--config.{dotted}.{next(iter(node[leaf].keys()))}=...")
    with node.unlocked():
        node[leaf] = parse_value(raw, node[leaf], f"config.{dotted}")


def set_field(config: ml_collections.ConfigDict, dotted: str, value, source: str) -> None:
    """Set a field from an already-parsed value (fsdp.json, Accelerate YAML), checking its type."""
    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
        node = node[name]
    expected = node[leaf]
    if isinstance(expected, bool) != isinstance(value, bool) or not isinstance(value, type(expected)):
        if isinstance(expected, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        else:
            raise UserError(source, f"must be a {type(expected).__name__} (got {value!r})")
    with node.unlocked():
        node[leaf] = value


def parse_value(raw: str, current, field: str):
    kind = type(current)
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(raw)
        if kind is float:
            value = float(raw)
            if not math.isfinite(value):
                raise UserError(field, f"expects a finite number, got {raw!r}")
            return value
        if kind is str:
            return raw
    except ValueError:
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise UserError(field, f"expects {article} {kind.__name__}, got {raw!r}") from None
    raise UserError(field, f"cannot be set from the command line (type {kind.__name__})")


def _unknown(config, dotted: str) -> None:
    known = sorted(_all_fields(config))
    close = difflib.get_close_matches(dotted, known, n=1)
    hint = f"; did you mean config.{close[0]}?" if close else "; see portable_fsdp/config.py for the fields"
    raise UserError(f"config.{dotted}", f"unknown field{hint}")


def _all_fields(config, prefix: str = ""):
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _all_fields(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def xla_fsdp_settings(config) -> dict:
    try:
        settings = json.loads(config.plan.xla_fsdp_settings)
    except json.JSONDecodeError as err:
        raise UserError("plan.xla_fsdp_settings", f"is not a JSON object ({err.msg})") from None
    if not isinstance(settings, dict):
        raise UserError("plan.xla_fsdp_settings", "must be a JSON object such as {\"compute_dtype\": \"bfloat16\"}")
    return settings
