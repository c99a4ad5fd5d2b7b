"""Turn a loaded ConfigDict into a validated ShardingPlan and check every other field, once, at start-up."""
from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math

from portable_fsdp import capabilities, plan as plan_lib

from portable_fsdp.training import trackers
from portable_fsdp.backend import ModelInfo
from portable_fsdp.config.schema import flat_fields
from portable_fsdp.errors import UserError, notify
from portable_fsdp.training.evaluation import resolve_metrics, resolve_preprocess
from portable_fsdp.training.profiling import profile_window
from portable_fsdp.mesh_fit import check_mesh_fits
from portable_fsdp.training.optimizers import OPTIMIZERS
from portable_fsdp.training.schedule import SHAPES as SCHEDULE_SHAPES
from portable_fsdp.training.sequence_split import check_divisible


def plan_from_config(config) -> plan_lib.ShardingPlan:
    """The plan the config's `plan` section declares (every field as plan.py declares it), validated."""
    p = config.plan
    hf_grad_ckpt = p.xla_fsdp_grad_ckpt and p.xla  # Hugging Face reads it with xla: true only (warned otherwise)
    if hf_grad_ckpt and config.train.gradient_checkpointing:  # name the field the user set
        raise UserError("plan.xla_fsdp_grad_ckpt", (
            "is on together with train.gradient_checkpointing; they recompute the same activations twice: keep "
            "plan.xla_fsdp_grad_ckpt and set train.gradient_checkpointing=false"))
    values = {field.name: field.from_config(p[field.name]) for field in plan_lib.plan_fields()}
    # HF's XLA spelling of the same request: with xla: true, honoured by every backend, not only xla.
    values["activation_checkpointing"] = p.activation_checkpointing or hf_grad_ckpt
    plan = plan_lib.build(plan_lib.ShardingPlan, values)
    plan.validate(model_gradient_checkpointing=config.train.gradient_checkpointing)
    return plan


def resolve_plan(config, world_size: int) -> plan_lib.ShardingPlan:
    """The plan with its mesh sized for `world_size`, and every field checked that needs no backend."""
    plan = plan_from_config(config)
    plan = dataclasses.replace(plan, mesh=plan.mesh.resolve(world_size))
    check_train_fields(config, plan.mesh.data_parallel_size)
    check_divisible(config.data.seq_len, plan.mesh.cp_size, plan.mesh.sp_size)
    return plan


def check_backend(config, plan: plan_lib.ShardingPlan, backend: str, device: str, nproc: int,
                  model: ModelInfo | None = None) -> None:
    """What the chosen lowering does with this config (portable_fsdp/capabilities.py), checked once before any
    worker starts: the first refused setting is a UserError naming it and the fix; each setting without
    effect there is one warning. `device` is the device type the run uses (cpu, cuda, tpu, ...); `model`, the
    backend's `describe_model`, adds the model's family and own settings (rules about them need it)."""
    target = capabilities.target_for(backend, plan.xla.xla_fsdp_v2)
    context = capability_context(config, plan, device, nproc, model)
    found = capabilities.verdicts(context, target)
    for rule, verdict in found:
        if isinstance(verdict, capabilities.Refused):
            raise UserError(rule.field, capabilities.message(rule, verdict, context, target))
    if model is not None:
        check_mesh_fits(plan, model)
    for rule, verdict in found:
        text = capabilities.message(rule, verdict, context, target)
        if isinstance(verdict, capabilities.Caution):
            notify(f"{rule.field}={capabilities.show(context[rule.field])}: {text}")
        else:
            notify(f"{rule.field} has no effect on --backend {backend}: {text}")


def capability_context(config, plan: plan_lib.ShardingPlan, device: str, nproc: int,
                       model: ModelInfo | None = None) -> dict:
    """What the capability table's conditions read: every config field by its dotted name — the plan's as the
    plan holds them (an enum by its canonical name, whatever case the user wrote) —, the device type, --nproc,
    and the model's own settings when known."""
    plan_values = {}
    for field in plan_lib.plan_fields():
        value = field.value_in(plan)
        plan_values[f"plan.{field.name}"] = (value.value if isinstance(value, enum.Enum)
                                             else list(value) if isinstance(value, tuple) else value)
    return {**flat_fields(config), **plan_values, "device": device.lower(), "--nproc": nproc, **model_fields(model)}


def model_fields(model: ModelInfo | None) -> dict:
    """The capability table's names for what a model's own config.json decides (capabilities.MODEL_FIELDS). A
    model of the user's own has no family (model_type ""): no config.json decides anything, no rule reads it."""
    if model is None or not model.model_type:
        return {}
    return {f"model.{name}": getattr(model, name) for name in capabilities.MODEL_FIELDS}


def _positive(value, field: str, allow_zero: bool = False) -> None:
    if not math.isfinite(value):
        raise UserError(field, f"must be a finite number (got {value})")
    if value < 0 or (value == 0 and not allow_zero):
        raise UserError(field, f"must be {'>= 0' if allow_zero else 'positive'} (got {value})")


def _check_length(t, d) -> None:
    """A run is train.steps long, or train.epochs when train.steps=0 (the launcher turns those into steps once it
    has counted the train split)."""
    _positive(t.epochs, "train.epochs", allow_zero=True)
    if not t.epochs:
        _positive(t.steps, "train.steps")
    elif t.steps:
        raise UserError("train.epochs", f"and train.steps={t.steps} are both set; set train.steps=0 to train "
                        "by epochs, or train.epochs=0")
    elif d.streaming:
        raise UserError("train.epochs", "needs the corpus's size, which data.streaming learns only as it trains; "
                        "set train.steps instead")


def _check_checkpoint_fields(t) -> None:
    from portable_fsdp.checkpoint.safetensors_shards import parse_size

    try:
        parse_size(t.max_shard_size)
    except ValueError as err:
        raise UserError("train.max_shard_size", f"{err}") from None
    if t.save_dtype not in ("float32", "bfloat16"):
        raise UserError("train.save_dtype", f"unknown value {t.save_dtype!r}; choose float32 or bfloat16")


# The adapter kinds model.peft.type builds (peft's PeftType, in lower case).
ADAPTER_TYPES = ("lora",)


def _check_adapters(peft) -> None:
    """model.peft: a known kind, a usable rank, scale and dropout, and peft installed."""
    if not peft.type:
        return
    if peft.type not in ADAPTER_TYPES:
        raise UserError("model.peft.type", f"unknown value {peft.type!r}; choose {', '.join(ADAPTER_TYPES)}, or "
                        "leave it empty to train the whole model")
    if peft.r < 1:
        raise UserError("model.peft.r", f"must be at least 1 (got {peft.r}); 8 or 16 is usual")
    _positive(peft.alpha, "model.peft.alpha")
    if not 0.0 <= peft.dropout < 1.0:
        raise UserError("model.peft.dropout", f"must be in [0, 1) (got {peft.dropout})")
    if importlib.util.find_spec("peft") is None:
        raise UserError("model.peft.type", "needs the peft package: pip install 'portable_fsdp[peft]'")


def check_train_fields(config, data_parallel_size: int) -> None:
    t, d, m = config.train, config.data, config.model
    _check_length(t, d)
    _check_adapters(m.peft)
    for name in ("batch_size", "grad_accum_steps", "eval_batch_size", "log_every", "keep_last_n",
                 "collective_timeout_s"):
        _positive(t[name], f"train.{name}")
    for name in ("eval_every", "save_every", "warmup_steps", "eval_max_batches", "stop_at_step", "max_grad_norm", "weight_decay",
                 "peak_flops_per_device", "loss_chunk_tokens"):
        _positive(t[name], f"train.{name}", allow_zero=True)
    _positive(t.lr, "train.lr")
    if t.nonfinite not in ("stop", "skip"):
        raise UserError("train.nonfinite", f"unknown value {t.nonfinite!r}; choose stop or skip")
    _positive(t.early_stopping_patience, "train.early_stopping_patience", allow_zero=True)
    for name in ("early_stopping_patience", "load_best_model_at_end"):
        if t[name] and not t.eval_every:
            raise UserError(f"train.{name}", "needs evaluations during training: set train.eval_every > 0")
    resolve_preprocess(t.preprocess_logits_for_metrics, resolve_metrics(t.compute_metrics))
    trackers.resolve(t.report_to)  # a tracker that is not installed: one line before anything starts
    _check_checkpoint_fields(t)
    profile_window(t.profile_steps, t.steps)
    if t.lr_schedule not in SCHEDULE_SHAPES:
        raise UserError("train.lr_schedule", f"unknown value {t.lr_schedule!r}; choose one of {', '.join(SCHEDULE_SHAPES)}")
    if t.optimizer not in OPTIMIZERS:
        raise UserError("train.optimizer", f"unknown value {t.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for name in ("decay_ratio", "momentum"):
        if not 0.0 <= t[name] <= 1.0:
            raise UserError(f"train.{name}", f"must be in [0, 1] (got {t[name]})")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise UserError("train.min_lr_ratio", f"must be in [0, 1] (got {t.min_lr_ratio})")
    for name in ("beta1", "beta2"):
        if not 0.0 <= t[name] < 1.0:
            raise UserError(f"train.{name}", f"must be in [0, 1) (got {t[name]})")
    per_step = data_parallel_size * t.grad_accum_steps
    if t.batch_size % per_step:
        raise UserError("train.batch_size", (
            f"{t.batch_size} sequences do not split over {data_parallel_size} data-parallel ranks x "
            f"{t.grad_accum_steps} accumulation steps; make it a multiple of {per_step}"))
    if t.eval_batch_size % data_parallel_size:
        raise UserError("train.eval_batch_size", (
            f"{t.eval_batch_size} does not split over {data_parallel_size} data-parallel ranks; "
            f"make it a multiple of {data_parallel_size}"))
    _positive(d.seq_len, "data.seq_len")
    if not 0.0 < d.eval_fraction < 1.0:
        raise UserError("data.eval_fraction", f"must be in (0, 1) (got {d.eval_fraction})")
    if d.format not in ("text", "chat"):
        raise UserError("data.format", f"unknown value {d.format!r}; choose text or chat")
    _positive(d.num_proc, "data.num_proc", allow_zero=True)
    _positive(d.eval_sequences, "data.eval_sequences")
    if not m.init_from and not m.config_from:  # else the sizes are the config.json's
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _positive(m[name], f"model.{name}")
        if m.hidden_size % m.num_attention_heads:
            raise UserError("model.num_attention_heads", (
                f"hidden_size {m.hidden_size} is not divisible by {m.num_attention_heads} heads"))
        if m.num_attention_heads % m.num_key_value_heads:
            raise UserError("model.num_key_value_heads", (
                f"{m.num_attention_heads} attention heads are not divisible by {m.num_key_value_heads} kv heads"))
        if d.seq_len > m.max_position_embeddings:
            raise UserError("data.seq_len", (
                f"{d.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
                "shorten data.seq_len or raise model.max_position_embeddings"))
