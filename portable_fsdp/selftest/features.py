"""The self-test's rows, as data: each a plan feature at smoke size (the config overrides that turn it on, the
model it trains, the devices it needs), and which of them a backend honours on this machine — read from the
capability table, as every start-up check reads it. Imports no framework."""
from __future__ import annotations

import dataclasses

from portable_fsdp import capabilities
from portable_fsdp.config.schema import apply_override, command_line_text, load_recipe
from portable_fsdp.config.validate import capability_context, plan_from_config

# The two smoke models, each a bundled recipe and overrides: a dense Llama, and a mixture of experts that every
# backend builds (Mixtral of the same sizes: 4 experts, 2 per token, with its router's load-balancing loss).
MODELS = {"llama": ("llama_tiny:test", {}),
          "moe": ("llama_tiny:test", {"model.architecture": "mixtral", "model.config_overrides": {
              "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
              "router_aux_loss_coef": 0.001, "sliding_window": None}})}
STEPS = 6
STOP = 3  # where a resumed row stops and continues
# Every row's run: a few logged steps, no eval, the learning rate up after two steps.
RUN = {"train.steps": STEPS, "train.log_every": 1, "train.eval_every": 0, "train.warmup_steps": 2,
       "train.progress_bar": False, "train.lr": 3e-3}

# Relative loss differences a row may show against one fp32 CPU process (step by step): float32 kernels differ in
# their order of summation (1e-4: what the GPU tests allow over 20 steps); bfloat16 keeps 8 bits of mantissa, and
# float8 products fewer.
FP32_RTOL = 1e-4
BF16_RTOL = 3e-2
FLOAT8_RTOL = 5e-2

TRAIN, RESUME, EXPORT = "train", "resume", "export"


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    what: str
    overrides: dict = dataclasses.field(default_factory=dict)
    model: str = "llama"
    min_devices: int = 1
    kind: str = TRAIN  # train: one run; resume: stopped at STOP, then resumed; export: a SHARDED run's export
    rtol: float = FP32_RTOL
    backends: tuple = ()  # the backends the row is for (all when empty)


FEATURES = (
    Feature("fsdp", "FSDP, parameters resharded after forward"),
    Feature("fsdp_no_reshard", "FSDP, gathered parameters kept for backward",
            {"plan.reshard_after_forward": "false"}),
    Feature("cpu_offload", "parameters, gradients and AdamW state in host memory", {"plan.cpu_offload": "true"}),
    Feature("activation_checkpointing", "every layer recomputed in backward", {"plan.activation_checkpointing": "true"}),
    Feature("bf16_fp32_reduce", "bfloat16 compute, float32 gradient reduction",
            {"plan.param_dtype": "bfloat16", "plan.reduce_dtype": "float32", "model.attn_implementation": "eager"},
            rtol=BF16_RTOL),
    Feature("cp_portable_allgather", "context parallelism, portable attention, all-gathered K/V",
            {"plan.cp_size": "2", "plan.cp_impl": "portable", "plan.cp_rotate_method": "allgather"}, min_devices=2),
    Feature("cp_portable_alltoall", "context parallelism, portable attention, K/V passed around the ring",
            {"plan.cp_size": "2", "plan.cp_impl": "portable", "plan.cp_rotate_method": "alltoall"}, min_devices=2),
    Feature("cp_torch_allgather", "context parallelism, torch's context_parallel, all-gathered K/V",
            {"plan.cp_size": "2", "plan.cp_impl": "torch", "plan.cp_rotate_method": "allgather"}, min_devices=2),
    Feature("cp_torch_alltoall", "context parallelism, torch's context_parallel, K/V passed around the ring",
            {"plan.cp_size": "2", "plan.cp_impl": "torch", "plan.cp_rotate_method": "alltoall"}, min_devices=2),
    Feature("cp", "context parallelism, sequences split by the compiler's sharding", {"plan.cp_size": "2"},
            min_devices=2, backends=("xla", "flax")),
    Feature("tp", "tensor parallelism", {"plan.tp_size": "2"}, min_devices=2),
    Feature("sp", "Ulysses sequence parallelism", {"plan.sp_size": "2"}, min_devices=2),
    Feature("moe", "mixture of experts, every expert on every rank", model="moe"),
    Feature("ep", "mixture of experts, experts split over 2 ranks", {"plan.ep_size": "2"}, model="moe",
            min_devices=2),
    Feature("hsdp", "HSDP: 2 replicas of the shards", {"plan.dp_replicate_size": "2"}, min_devices=2),
    Feature("fsdp_v1", "torch_xla's FSDP v1", {"plan.xla_fsdp_v2": "false"}, backends=("xla",)),
    Feature("compile", "each layer compiled (torch.compile)", {"plan.compile": "true"}),
    Feature("float8", "float8 matmuls (torchao), compiled layers",
            {"plan.float8": "true", "plan.compile": "true", "plan.param_dtype": "bfloat16",
             "plan.reduce_dtype": "float32"}, rtol=FLOAT8_RTOL),
    Feature("sharded_resume", f"SHARDED save at step {STOP}, resumed",
            {"plan.state_dict_type": "SHARDED_STATE_DICT"}, kind=RESUME),
    Feature("full_resume", f"FULL save at step {STOP}, resumed", {"plan.state_dict_type": "FULL_STATE_DICT"},
            kind=RESUME),
    Feature("background_save_resume", f"SHARDED save in the background at step {STOP}, resumed",
            {"plan.state_dict_type": "SHARDED_STATE_DICT", "train.async_save": "true"}, kind=RESUME),
    Feature("export", "a SHARDED run's FULL export: the weights one CPU process trained",
            {"plan.state_dict_type": "SHARDED_STATE_DICT", "train.export_full_at_end": "true"}, kind=EXPORT),
)
NAMES = tuple(feature.name for feature in FEATURES)


def run_settings(devices: int) -> dict:
    """What every row's run sets besides its own overrides: RUN, and a global batch every data-parallel rank of
    `devices` gets rows of (4 sequences, 2 per device past 2 devices)."""
    batch = max(4, 2 * devices)
    return {**RUN, "train.batch_size": batch, "train.eval_batch_size": batch}


def model_config(model: str, devices: int, overrides: dict | None = None):
    """The smoke recipe of `model` with the run settings for `devices` devices and `overrides` on top."""
    recipe, model_overrides = MODELS[model]
    config = load_recipe(recipe)
    for key, value in {**model_overrides, **run_settings(devices), **(overrides or {})}.items():
        apply_override(config, key, command_line_text(value))
    return config


def not_honoured(feature: Feature, backend: str, device: str, devices: int, model_info) -> str:
    """Why `backend` does not run `feature` on `devices` devices of type `device` ("" when it does): the row is
    for other backends, needs more devices, or the capability table refuses a setting of it there, or says it has
    no effect (it would only repeat another row)."""
    if feature.backends and backend not in feature.backends:
        return f"for --backend {' / '.join(feature.backends)}"
    if devices < feature.min_devices:
        return f"needs {feature.min_devices} devices ({devices} here)"
    config = model_config(feature.model, devices, feature.overrides)
    plan = plan_from_config(config)
    context = capability_context(config, plan, device, devices, model_info)
    target = capabilities.target_for(backend, plan.xla.xla_fsdp_v2)
    for rule, verdict in capabilities.verdicts(context, target):
        if isinstance(verdict, capabilities.Refused):
            why = capabilities.message(rule, verdict, context, target)
            return f"refused on --backend {backend}: {rule.field}: {why}"
        if isinstance(verdict, capabilities.NoEffect):
            return f"{rule.field} has no effect on --backend {backend}"
    return ""


def reference_overrides(feature: Feature) -> dict:
    """The overrides the CPU reference takes: the row's model and training fields, never its plan (nor what only
    says how checkpoints are written)."""
    return {k: v for k, v in feature.overrides.items()
            if not k.startswith("plan.") and k not in ("train.async_save", "train.export_full_at_end")}
