"""A Hugging Face `TrainingArguments` as our config (`pf.from_training_arguments`).

What decides the numbers trained (batch, steps, learning rate and its schedule, AdamW, clipping, precision, seed)
and when things happen (eval, save, log) is always taken from the arguments, defaults included: the run is the one
Trainer would do. What only decides how it runs (fsdp, fsdp_config, parallelism_config, gradient checkpointing,
compile, checkpoints kept, trackers, the progress bar, the collective timeout) is taken when set, and leaves the recipe's choice otherwise.
Any other argument that is not at its default has no equivalent here and is refused by name.

Our train.batch_size is the global batch; Trainer's is per device. The data-parallel size that converts one into
the other is the parallelism_config's when one is given (Accelerate requires its sizes to multiply to the world),
else that of the recipe's mesh over `world_size` (default: $WORLD_SIZE, as torchrun and accelerate launch set
it, else 1). Imports neither transformers nor accelerate: the arguments are read by their attribute names.
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings

from portable_fsdp.config.hf_import import (MIXED_PRECISION, PARALLELISM_KEYS, apply_fsdp_dict, apply_fsdp_file,
                                           apply_fsdp_option)
from portable_fsdp.config.schema import load_recipe, set_field
from portable_fsdp.config.validate import plan_from_config
from portable_fsdp.errors import UserError, notify
from portable_fsdp.training.trackers import TRACKERS

# lr_scheduler_type -> (train.lr_schedule, whether Trainer warms it up); every one decays to 0 but
# cosine_with_min_lr, whose floor lr_scheduler_kwargs gives.
SCHEDULES = {"linear": ("linear", True), "cosine": ("cosine", True), "cosine_with_min_lr": ("cosine", True),
             "constant_with_warmup": ("constant", True), "constant": ("constant", False)}
# Trainer's optim -> train.optimizer, where both run the same update: torch's AdamW; torch.optim.SGD (optim_args'
# momentum); bitsandbytes' 32-bit Lion, betas from adam_beta1/adam_beta2 as Trainer passes them. Trainer's adafactor
# is transformers' own (relative steps, parameter scaling), not torch's that train.optimizer=adafactor runs.
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd", "lion_32bit": "lion"}
# fsdp_config keys TrainingArguments adds itself, with these values, when fsdp is on: they were not written by the
# user, and read as written they would change our defaults (xla_fsdp_v2=false is FSDP v1 on --backend xla).
INJECTED_FSDP_KEYS = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}
MESH_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")  # ParallelismConfig's
# Arguments with no effect on what is trained, which TrainingArguments itself may change (do_eval follows
# eval_strategy, dataloader_pin_memory use_cpu, torch_compile_backend torch_compile), and use_cpu, which Trainer
# needs for bf16 on a CPU: the device is the backend's (pf.train(config, backend=...)).
NO_EFFECT = ("do_train", "do_eval", "do_predict", "dataloader_pin_memory", "torch_compile_backend", "use_cpu")


def from_training_arguments(args, recipe: str | None = None, *, world_size: int | None = None):
    """The locked config of `recipe` (None = the default job) with `args`, a transformers.TrainingArguments, mapped
    onto it. `world_size`: the processes the run will have (default $WORLD_SIZE, else 1); not needed when
    args.parallelism_config sizes the mesh. A setting with no equivalent is a UserError naming it."""
    if not dataclasses.is_dataclass(args) or not hasattr(args, "per_device_train_batch_size"):
        raise UserError("args", f"must be a transformers.TrainingArguments (got {type(args).__name__})")
    config = load_recipe(recipe)
    with warnings.catch_warnings():  # constructing it repeats what `args` already said (deprecations, devices)
        warnings.simplefilter("ignore")
        reference = type(args)()  # the defaults, normalised by the same __post_init__ as `args`
    changed = [f.name for f in dataclasses.fields(args)  # in the order TrainingArguments declares them
               if f.init and _plain(getattr(args, f.name)) != _plain(getattr(reference, f.name))]
    _apply_layout(config, args, changed)
    _apply_numbers(config, args, _data_parallel_size(config, args, world_size))
    _apply_cadence(config, args)
    _apply_tools(config, args, changed)
    unmapped = [name for name in changed if name not in HANDLED]
    if unmapped:
        name = unmapped[0]
        raise UserError(f"TrainingArguments.{name}", (
            f"has no equivalent in portable_fsdp; leave it at its default ({_plain(getattr(reference, name))!r}) — "
            "docs/hf_compat.md lists the arguments that map"))
    if "output_dir" in changed:
        notify(f"TrainingArguments.output_dir={args.output_dir!r} is the run's workdir, not a config field: "
               f"pass it as pf.train(config, workdir={args.output_dir!r})")
    return config


def _plain(value):
    """An enum as its value (TrainingArguments turns strategy strings into enums)."""
    return getattr(value, "value", value)


def _source(name: str) -> str:
    return f"TrainingArguments.{name}"


# ---------------------------------------------------------------- how it runs: the plan

def _apply_layout(config, args, changed: list) -> None:
    if isinstance(args.fsdp, (list, tuple)):  # transformers 4 kept the option words; 5 moves them to fsdp_config
        apply_fsdp_option(config, " ".join(str(_plain(word)) for word in args.fsdp))
    elif isinstance(args.fsdp, str) and args.fsdp:
        apply_fsdp_option(config, args.fsdp)
    if isinstance(args.fsdp_config, str):
        apply_fsdp_file(config, args.fsdp_config)
    elif args.fsdp_config:
        written = {key: value for key, value in args.fsdp_config.items()
                   if key not in INJECTED_FSDP_KEYS or value != INJECTED_FSDP_KEYS[key]}
        apply_fsdp_dict(config, written, _source("fsdp_config"))
    if args.parallelism_config is not None:
        _apply_parallelism(config, args.parallelism_config)
    if "torch_compile" in changed:  # one compiled graph per layer: the same numbers as Trainer's whole-model compile
        set_field(config, "plan.compile", bool(args.torch_compile), _source("torch_compile"))
    if "activation_checkpointing" in changed:  # the model's own (gradient_checkpointing is its older name)
        set_field(config, "train.gradient_checkpointing", bool(args.activation_checkpointing),
                  _source("activation_checkpointing"))
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    set_field(config, "plan.param_dtype", MIXED_PRECISION[precision], _source("fp16" if args.fp16 else "bf16"))


def _apply_parallelism(config, parallelism) -> None:
    """Accelerate's ParallelismConfig: its sizes are the mesh's; the handlers' settings are each lowering's own,
    except the context-parallel all-gather / all-to-all choice."""
    for name in MESH_SIZES:
        set_field(config, f"plan.{PARALLELISM_KEYS[name]}", getattr(parallelism, name),
                  f"{_source('parallelism_config')}.{name}")
    strategy = getattr(parallelism.cp_handler, "cp_comm_strategy", None) if parallelism.cp_size > 1 else None
    if strategy:
        set_field(config, f"plan.{PARALLELISM_KEYS['cp_comm_strategy']}", strategy,
                  f"{_source('parallelism_config')}.cp_handler.cp_comm_strategy")


def _data_parallel_size(config, args, world_size: int | None) -> int:
    parallelism = args.parallelism_config
    if parallelism is not None:
        if world_size is not None and world_size != parallelism.total_size:
            raise UserError("world_size", (
                f"is {world_size} but TrainingArguments.parallelism_config's sizes multiply to "
                f"{parallelism.total_size}; give the world the config describes, or leave world_size out"))
        return parallelism.dp_replicate_size * parallelism.dp_shard_size
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    return plan_from_config(config).mesh.resolve(world).data_parallel_size


# ---------------------------------------------------------------- what is trained

def _apply_numbers(config, args, data_parallel: int) -> None:
    steps = max(args.max_steps, 0)  # Trainer's -1: as many steps as num_train_epochs take (train.steps=0)
    if not steps and args.num_train_epochs <= 0:
        raise UserError(_source("num_train_epochs"), (
            f"is {args.num_train_epochs} and max_steps is {args.max_steps}: give the passes over the data to train, "
            "or max_steps"))
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    set_field(config, "train.steps", steps, _source("max_steps"))
    if not steps:  # the steps follow from the train split's size once the data is read (data/loader.resolve_epochs)
        set_field(config, "train.epochs", float(args.num_train_epochs), _source("num_train_epochs"))
    set_field(config, "train.grad_accum_steps", accumulation, _source("gradient_accumulation_steps"))
    set_field(config, "train.batch_size", per_device * accumulation * data_parallel,
              _source("per_device_train_batch_size"))
    set_field(config, "train.eval_batch_size", args.per_device_eval_batch_size * data_parallel,
              _source("per_device_eval_batch_size"))
    set_field(config, "train.lr", args.learning_rate, _source("learning_rate"))
    _apply_schedule(config, args, steps)
    for name, field in (("weight_decay", "weight_decay"), ("adam_beta1", "beta1"), ("adam_beta2", "beta2"),
                        ("adam_epsilon", "eps"), ("max_grad_norm", "max_grad_norm")):
        set_field(config, f"train.{field}", float(getattr(args, name)), _source(name))
    _apply_optimizer(config, args)
    if args.data_seed is not None and args.data_seed != args.seed:
        raise UserError(_source("data_seed"), (
            f"is {args.data_seed}, apart from seed {args.seed}: one seed decides both the weights and the data "
            "order here; leave data_seed unset or equal to seed"))
    set_field(config, "seed", args.seed, _source("seed"))


def _apply_optimizer(config, args) -> None:
    name = _plain(args.optim)
    if name not in OPTIMIZERS:
        raise UserError(_source("optim"), (
            f"{name} has no equivalent here; choose one of {', '.join(OPTIMIZERS)}, or set train.optimizer "
            "(docs/optimizers.md)"))
    set_field(config, "train.optimizer", OPTIMIZERS[name], _source("optim"))
    extra = {} if args.optim_args is None else dict(
        item.split("=", 1) for item in args.optim_args.replace(" ", "").split(",") if item)
    unread = sorted(set(extra) - ({"momentum"} if name == "sgd" else set()))
    if unread:
        raise UserError(_source("optim_args"), (
            f"{', '.join(unread)} has no equivalent for {name}; leave optim_args unset"
            + (" or give only momentum" if name == "sgd" else "")))
    if "momentum" in extra:
        set_field(config, "train.momentum", float(extra["momentum"]), _source("optim_args"))
    elif name == "sgd":  # torch.optim.SGD's default, not the config's
        set_field(config, "train.momentum", 0.0, _source("optim"))


def _apply_schedule(config, args, steps: int) -> None:
    kind = _plain(args.lr_scheduler_type)
    if kind not in SCHEDULES:
        raise UserError(_source("lr_scheduler_type"), (
            f"{kind} has no equivalent; choose one of {', '.join(SCHEDULES)}"))
    shape, warms_up = SCHEDULES[kind]
    set_field(config, "train.lr_schedule", shape, _source("lr_scheduler_type"))
    set_field(config, "train.min_lr_ratio", _floor(args, kind), _source("lr_scheduler_kwargs"))
    warmup = _steps(args.warmup_steps, steps, "warmup_steps") if warms_up else 0
    set_field(config, "train.warmup_steps", warmup, _source("warmup_steps"))
    if warmup:
        notify(f"TrainingArguments.warmup_steps: the warm-up reaches learning_rate one step earlier than "
               f"Trainer's: optimizer step s (from 0) runs at learning_rate*(s+1)/{warmup}, Trainer's at "
               f"learning_rate*s/{warmup}")


def _floor(args, kind: str) -> float:
    """min_lr_ratio from lr_scheduler_kwargs: cosine_with_min_lr's min_lr_rate or min_lr; cosine's num_cycles
    only as half a cycle (ours)."""
    kwargs = dict(args.lr_scheduler_kwargs or {})
    field = _source("lr_scheduler_kwargs")
    if kind in ("cosine", "cosine_with_min_lr") and kwargs.pop("num_cycles", 0.5) != 0.5:
        raise UserError(field, "num_cycles other than 0.5 (one half-cosine to the floor) has no equivalent")
    floor = 0.0
    if kind == "cosine_with_min_lr":
        if "min_lr_rate" in kwargs:
            floor = kwargs.pop("min_lr_rate")
        elif "min_lr" in kwargs:
            floor = kwargs.pop("min_lr") / args.learning_rate
        else:
            raise UserError(field, "cosine_with_min_lr needs min_lr_rate or min_lr")
    if kwargs:
        raise UserError(field, f"{', '.join(sorted(kwargs))} has no equivalent for {kind}; remove it")
    return float(floor)


def _steps(value: float, total: int, name: str) -> int:
    """Trainer's step counts: at least 1 is a number of steps, below 1 a fraction of the total, rounded up (a total
    of 0: a run of num_train_epochs, whose steps are not known before the data is read)."""
    if value >= 1 or value <= 0:
        return int(value)
    if not total:
        raise UserError(_source(name), (
            f"is {value:g}, a fraction of the run's steps, which num_train_epochs leaves unknown until the data is "
            f"read; give {name} as a number of steps, or set max_steps"))
    return math.ceil(total * value)


# ---------------------------------------------------------------- when: eval, save, log

def _apply_cadence(config, args) -> None:
    total = config.train.steps
    eval_every = _every(args, "eval", args.eval_steps, total)
    set_field(config, "train.eval_every", eval_every, _source("eval_strategy"))
    set_field(config, "train.save_every", _every(args, "save", args.save_steps, total), _source("save_strategy"))
    if _plain(args.logging_strategy) != "steps":
        raise UserError(_source("logging_strategy"), (
            f"{_plain(args.logging_strategy)} has no equivalent: the run logs every logging_steps; use steps"))
    set_field(config, "train.log_every", _steps(args.logging_steps, total, "logging_steps"), _source("logging_steps"))
    if args.load_best_model_at_end:
        if args.metric_for_best_model not in ("loss", "eval_loss") or args.greater_is_better:
            raise UserError(_source("metric_for_best_model"), (
                f"{args.metric_for_best_model!r}: the best model is the one of the lowest eval_loss; use loss"))
        set_field(config, "train.load_best_model_at_end", True, _source("load_best_model_at_end"))


def _every(args, what: str, steps: float, total: int) -> int:
    """eval_strategy / save_strategy -> train.eval_every / save_every (0: only at the end)."""
    strategy = _plain(getattr(args, f"{what}_strategy"))
    if strategy == "no":
        return 0
    if strategy != "steps":
        raise UserError(_source(f"{what}_strategy"), (
            f"{strategy} has no equivalent: the config counts optimizer steps; use steps with {what}_steps"))
    return _steps(steps, total, f"{what}_steps")


# ---------------------------------------------------------------- tools around the run

def _apply_tools(config, args, changed: list) -> None:
    if "save_total_limit" in changed:
        set_field(config, "train.keep_last_n", args.save_total_limit, _source("save_total_limit"))
    if "report_to" in changed:
        unknown = [name for name in args.report_to if name not in TRACKERS]
        if unknown:
            raise UserError(_source("report_to"), (
                f"{', '.join(unknown)} has no equivalent; choose from {', '.join(TRACKERS)} (or none)"))
        set_field(config, "train.report_to", ",".join(args.report_to) or "none", _source("report_to"))
    if "disable_tqdm" in changed:
        set_field(config, "train.progress_bar", not args.disable_tqdm, _source("disable_tqdm"))
    if "ddp_timeout" in changed:
        set_field(config, "train.collective_timeout_s", int(args.ddp_timeout), _source("ddp_timeout"))


# Every argument read above (or derived by TrainingArguments from one of them); the others must be at their default.
HANDLED = frozenset({
    "fsdp", "fsdp_config", "parallelism_config", "torch_compile", "activation_checkpointing",
    "gradient_checkpointing", "bf16", "fp16", "max_steps", "num_train_epochs", "per_device_train_batch_size",
    "gradient_accumulation_steps", "per_device_eval_batch_size", "learning_rate", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "optim", "optim_args", "seed", "data_seed", "eval_strategy", "eval_steps", "save_strategy", "save_steps",
    "logging_strategy", "logging_steps", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "save_total_limit", "report_to", "disable_tqdm", "ddp_timeout", "output_dir", *NO_EFFECT})
