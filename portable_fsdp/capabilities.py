"""What each backend does with each plan field and value — honoured, refused (with the fix), or without effect
on that backend — as data. Imports no framework.

`validate.check_backend` reads this table once, before any worker starts: a refused setting is one `error:`
line naming the field and the fix, a setting without effect is one warning. A setting no rule matches is
honoured. `python -m portable_fsdp.capabilities` prints the table as the markdown of docs/capabilities.md
(a test keeps the two equal).

Targets are the lowerings as the user meets them: `cpu` and `cuda` (torch FSDP2 over gloo / NCCL), `xla`
(torch_xla SPMD FSDPv2, the default) and `xla_v1` (torch_xla FSDP v1, `plan.xla_fsdp_v2=false`), and `flax`.
A rule's condition reads the config's fields by their dotted names, plus `device` (the device type the run
will use: cpu, cuda, tpu, ...) and `--nproc` (the processes or devices asked for).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

# The table's columns, and their headings in docs/capabilities.md.
TARGET_NAMES = {"cpu": "cpu (FSDP2, gloo)", "cuda": "cuda (FSDP2, NCCL)", "xla": "xla (SPMD FSDPv2)",
                "xla_v1": "xla (FSDP v1)", "flax": "flax (JAX)"}
TARGETS = tuple(TARGET_NAMES)
TORCH = ("cpu", "cuda")
XLA = ("xla", "xla_v1")
NOT_CUDA = ("cpu", "xla", "xla_v1")


# ------------------------------------------------------------------ conditions (data: field -> test of its value)
@dataclasses.dataclass(frozen=True)
class Is:
    value: object

    def holds(self, value, context) -> bool:
        return value == self.value

    def describe(self) -> str:
        return f"= {show(self.value)}"


@dataclasses.dataclass(frozen=True)
class IsNot:
    value: object

    def holds(self, value, context) -> bool:
        return value != self.value

    def describe(self) -> str:
        return f"≠ {show(self.value)}"


@dataclasses.dataclass(frozen=True)
class OneOf:
    values: tuple

    def holds(self, value, context) -> bool:
        return value in self.values

    def describe(self) -> str:
        return "∈ {" + ", ".join(map(show, self.values)) + "}"


@dataclasses.dataclass(frozen=True)
class NoneOf:
    values: tuple

    def holds(self, value, context) -> bool:
        return value not in self.values

    def describe(self) -> str:
        return "∉ {" + ", ".join(map(show, self.values)) + "}"


@dataclasses.dataclass(frozen=True)
class Above:
    bound: int

    def holds(self, value, context) -> bool:
        return value > self.bound

    def describe(self) -> str:
        return f"> {self.bound}"


@dataclasses.dataclass(frozen=True)
class NeitherOf:
    """The value is neither `literal` nor the value of the field `other`."""

    literal: object
    other: str

    def holds(self, value, context) -> bool:
        return value not in (self.literal, context[self.other])

    def describe(self) -> str:
        return f"∉ {{{show(self.literal)}, {self.other}}}"


@dataclasses.dataclass(frozen=True)
class Shorter:
    """A length that is set (> 0) and shorter than the value of the field `other`."""

    other: str

    def holds(self, value, context) -> bool:
        return 0 < value < context[self.other]

    def describe(self) -> str:
        return f"∈ [1, {self.other})"


SET = IsNot([])  # a non-empty list field
ON = Is(True)


def show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# ------------------------------------------------------------------ verdicts
@dataclasses.dataclass(frozen=True)
class Refused:
    fix: str  # what is wrong and what to write instead; `{value}`, `{device}`, `{target}` and `{a.field}` filled in


@dataclasses.dataclass(frozen=True)
class NoEffect:
    why: str


@dataclasses.dataclass(frozen=True)
class Caution:
    """Honoured, with one warning: it runs as asked but costs what the user may not expect."""

    why: str


@dataclasses.dataclass(frozen=True)
class Rule:
    field: str  # the field the message names
    when: tuple  # ((field, condition), ...): all must hold
    verdicts: Mapping  # target -> Refused | NoEffect | Caution; targets not named honour the setting


XLA_DECIDES = NoEffect("the XLA compiler decides how devices exchange data")
XLA_SCHEDULES = NoEffect("XLA decides how the sharded computation is scheduled")

# What a model's own config.json decides (portable_fsdp.backend.ModelInfo's fields): the context has them as
# model.<name> when the model is known (validate.check_backend with describe_model's info); a rule about
# them does not apply where the model is not known.
MODEL_FIELDS = ("model_type", "attention_dropout", "attention_dropout_key", "sliding_window")
FLAX_FAMILIES = ("llama", "qwen2", "mistral", "mixtral")  # the transformers model_types portable_fsdp/backends/flax builds
CP_DROPOUT = ("= {value} (the model's {model.attention_dropout_key}): the portable context-parallel attention "
              "applies no dropout; set the model's {model.attention_dropout_key} to 0 in its config.json, or "
              "plan.cp_size=1")
COMPILE_PORTABLE = ("with plan.{axis}={{plan.{axis}}}: the {what} attention reads each batch's shard layout from a "
                    "context variable, which torch.compile cannot trace inside a layer compiled whole; set "
                    "plan.compile=false or plan.{axis}=1")

RULES = (
    # ---- the mesh axes besides fsdp and cp (what must divide what: portable_fsdp/mesh_fit.py)
    *(Rule(f"plan.{axis}_size", ((f"plan.{axis}_size", Above(1)),), {"xla_v1": Refused(
        f"= {{value}}: FSDP v1 (XlaFullyShardedDataParallel) shards over one axis and cannot {does}; use SPMD "
        f"FSDPv2 (plan.xla_fsdp_v2=true), where it is a named mesh axis, or set plan.{axis}_size=1")})
      for axis, does in (("tp", "split layers"), ("sp", "split sequences"), ("ep", "split experts"),
                         ("dp_replicate", "replicate shards"))),
    # ---- context parallelism
    Rule("plan.cp_size", (("plan.cp_size", Above(1)),), {"xla_v1": Refused(
        "= {value}: FSDP v1 (XlaFullyShardedDataParallel) cannot split sequences; use SPMD FSDPv2 "
        "(plan.xla_fsdp_v2=true), which shards them over the mesh's cp axis, or set plan.cp_size=1")}),
    Rule("plan.cp_impl", (("plan.cp_size", Above(1)), ("plan.cp_impl", Is("torch"))), {
        "cpu": Refused("torch's context_parallel needs CUDA SDPA kernels and cannot run on {device}; "
                       "use plan.cp_impl=portable (or auto)"),
        "xla": Refused("torch's context_parallel needs CUDA SDPA kernels; on --backend xla sequences "
                       "are split by SPMD sharding: use plan.cp_impl=auto"),
        "flax": XLA_SCHEDULES}),
    Rule("plan.cp_impl", (("plan.cp_size", Above(1)), ("plan.cp_impl", Is("portable"))), {
        "xla": XLA_DECIDES, "flax": XLA_SCHEDULES}),
    Rule("plan.cp_load_balance", (("plan.cp_size", Above(1)), ("plan.cp_impl", OneOf(("auto", "torch"))),
                                  ("plan.cp_load_balance", Is(False))), {
        "cuda": Refused("= false is not supported by torch's context_parallel (plan.cp_impl=auto takes it on "
                        "CUDA; it always splits head-tail): set plan.cp_impl=portable or keep "
                        "plan.cp_load_balance=true")}),
    Rule("plan.cp_load_balance", (("plan.cp_size", Above(1)), ("plan.cp_load_balance", Is(False))), {
        "xla": XLA_DECIDES, "flax": XLA_SCHEDULES}),
    Rule("plan.cp_rotate_method", (("plan.cp_size", Above(1)), ("plan.cp_rotate_method", IsNot("allgather"))), {
        "xla": XLA_DECIDES, "flax": XLA_SCHEDULES}),
    Rule("data.document_masking", (("plan.cp_size", Above(1)), ("plan.cp_impl", OneOf(("auto", "torch"))),
                                   ("data.document_masking", ON)), {
        "cuda": Refused("= true: torch's context_parallel (plan.cp_impl=auto takes it on CUDA) supports causal "
                        "attention only; use plan.cp_impl=portable, which honours document boundaries exactly")}),
    # ---- Ulysses sequence parallelism
    Rule("model.attn_implementation", (("plan.sp_size", Above(1)),
                                       ("model.attn_implementation", NoneOf(("sdpa", "eager")))), dict.fromkeys(
        TORCH, Refused("= {value}: Ulysses sequence parallelism on --backend {target} runs the model's sdpa or eager "
                       "attention over the whole sequence on each rank's heads; set model.attn_implementation=sdpa"))),
    # ---- where the weights live and how they are gathered
    Rule("plan.cpu_offload", (("plan.cpu_offload", ON),), {
        **dict.fromkeys(XLA, Refused(
            "torch_xla's FSDP (SPMD FSDPv2 and XlaFullyShardedDataParallel) cannot keep parameters or optimizer "
            "state in host memory; set plan.cpu_offload=false (or use --backend cpu / cuda for CPU offload)"))}),
    Rule("plan.cpu_offload", (("plan.cpu_offload", ON), ("device", IsNot("cpu"))), {
        "flax": Refused("is not available on --backend flax with {device} devices; set it to false")}),
    Rule("plan.cpu_offload", (("plan.cpu_offload", ON), ("--nproc", Is(1))), {
        "cpu": NoEffect("a world of one rank trains the plain module, whose parameters and optimizer state are in "
                        "host memory already"),
        "cuda": Caution("with one rank FSDP2 still wraps the model, over that rank alone, to keep the parameters, "
                        "gradients and optimizer state in host memory and copy each layer's parameters to the GPU "
                        "when it runs (one rank otherwise trains the plain module)")}),
    Rule("plan.reshard_after_forward", (("plan.reshard_after_forward", Is(False)),), {
        "xla": Refused("= false has no SPMD FSDPv2 equivalent: there the XLA compiler decides when gathered "
                       "parameters are freed; set it to true, or use FSDP v1 (plan.xla_fsdp_v2=false), which keeps "
                       "them gathered"),
        "flax": XLA_SCHEDULES}),
    Rule("plan.auto_wrap_policy", (("plan.auto_wrap_policy", IsNot("TRANSFORMER_BASED_WRAP")),), {
        "flax": XLA_SCHEDULES}),
    Rule("plan.min_num_params", (("plan.min_num_params", Above(0)),
                                 ("plan.auto_wrap_policy", IsNot("SIZE_BASED_WRAP"))), dict.fromkeys(
        TARGETS, NoEffect("it is read by plan.auto_wrap_policy=SIZE_BASED_WRAP only; set that policy to wrap by "
                          "size"))),
    Rule("plan.auto_wrap_policy", (("plan.auto_wrap_policy", Is("NO_WRAP")),), dict.fromkeys(
        (*TORCH, *XLA), Caution("the whole model is one FSDP unit, so every parameter is gathered at once and "
                                "sharding saves no memory at compute time"))),
    Rule("plan.cpu_ram_efficient_loading", (("plan.cpu_ram_efficient_loading", ON),), {
        "xla_v1": Refused("has no FSDP v1 equivalent in torch_xla: every process builds the whole model; set it "
                          "to false, or use SPMD FSDPv2 (plan.xla_fsdp_v2=true), where the host fills each "
                          "parameter into its shards in turn and never holds the whole model"),
        "flax": NoEffect("one process builds the model and places its shards")}),
    Rule("train.async_save", (("train.async_save", ON), ("plan.state_dict_type", Is("FULL_STATE_DICT"))),
         dict.fromkeys(TARGETS, Refused("applies to SHARDED_STATE_DICT saves (a FULL one is gathered and written "
                                        "while training waits); set plan.state_dict_type=SHARDED_STATE_DICT or "
                                        "train.async_save=false"))),
    Rule("train.async_save", (("train.async_save", ON), ("plan.state_dict_type", Is("SHARDED_STATE_DICT"))),
         dict.fromkeys(XLA, NoEffect("xla writes its shard files while training waits"))),
    # ---- mixed precision
    Rule("plan.param_dtype", (("plan.param_dtype", Is("float16")),), {
        "xla": Refused("float16 has no SPMD FSDPv2 equivalent: torch_xla's autocast computes in bfloat16; use "
                       "bfloat16"),
        **dict.fromkeys((*TORCH, "xla_v1", "flax"), Refused(
            "float16 trains only with loss scaling (gradients below float16's range become 0), which this lowering "
            "does not apply; use bfloat16 (Accelerate: mixed_precision: bf16), which needs none"))}),
    Rule("plan.reduce_dtype", (("plan.reduce_dtype", IsNot("float32")),), {
        "xla": Refused("{value} has no SPMD FSDPv2 equivalent: the XLA compiler places the gradient reductions "
                       "itself; set plan.reduce_dtype=float32, or use FSDP v1 (plan.xla_fsdp_v2=false)"),
        "flax": NoEffect("gradients are reduced inside the compiled step, in float32")}),
    Rule("plan.reduce_dtype", (("plan.reduce_dtype", NeitherOf("float32", "plan.param_dtype")),), {
        "xla_v1": Refused("{value} with plan.param_dtype={plan.param_dtype}: XlaFullyShardedDataParallel reduces "
                          "gradients in the compute dtype or in float32 (fp32_reduce_scatter); set "
                          "plan.reduce_dtype=float32 or plan.reduce_dtype={plan.param_dtype}")}),
    Rule("plan.param_dtype", (("plan.param_dtype", Is("bfloat16")), ("model.attn_implementation", Is("sdpa"))), {
        "xla": Refused("bfloat16 under SPMD FSDPv2 is torch_xla's autocast, which does not cover "
                       "scaled_dot_product_attention (it would get mixed float32/bfloat16 inputs); set "
                       "model.attn_implementation=eager, or use FSDP v1 (plan.xla_fsdp_v2=false), which casts the "
                       "parameters")}),
    # ---- the GPU fast path: compiled layers, float8 matmuls
    Rule("plan.compile", (("plan.compile", ON),), {
        **dict.fromkeys(XLA, NoEffect("torch_xla traces every step and compiles it with XLA anyway")),
        "flax": NoEffect("every step is compiled whole by jax.jit anyway")}),
    Rule("plan.compile", (("plan.compile", ON), ("plan.cp_size", Above(1)), ("plan.cp_impl", Is("portable"))), {
        "cuda": Refused(COMPILE_PORTABLE.format(what="context-parallel", axis="cp_size"))}),
    Rule("plan.compile", (("plan.compile", ON), ("plan.cp_size", Above(1))), {
        "cpu": Refused(COMPILE_PORTABLE.format(what="context-parallel", axis="cp_size"))}),
    Rule("plan.compile", (("plan.compile", ON), ("plan.cp_size", Above(1)),
                          ("plan.cp_impl", OneOf(("auto", "torch")))), {
        "cuda": Refused("with plan.cp_size={plan.cp_size}: layers compiled whole under torch's context_parallel "
                        "(plan.cp_impl=auto takes it on CUDA; it patches scaled_dot_product_attention during each "
                        "step) are unverified against eager training; set plan.compile=false or plan.cp_size=1")}),
    Rule("plan.compile", (("plan.compile", ON), ("plan.sp_size", Above(1))), dict.fromkeys(
        TORCH, Refused(COMPILE_PORTABLE.format(what="Ulysses sequence-parallel", axis="sp_size")))),
    Rule("plan.compile", (("plan.compile", ON), ("plan.ep_size", Above(1))), dict.fromkeys(TORCH, Refused(
        "with plan.ep_size={plan.ep_size}: each layer's experts are an FSDP unit of their own inside the layer, "
        "and torch.compile cannot run FSDP's hooks inside a layer compiled whole; set plan.compile=false or "
        "plan.ep_size=1"))),
    Rule("plan.compile", (("plan.compile", ON), ("plan.auto_wrap_policy", Is("SIZE_BASED_WRAP"))), dict.fromkeys(
        TORCH, Refused("with plan.auto_wrap_policy=SIZE_BASED_WRAP: FSDP units chosen by size can lie inside a "
                       "transformer layer, and torch.compile cannot run FSDP's hooks inside a layer compiled whole; "
                       "use plan.auto_wrap_policy=TRANSFORMER_BASED_WRAP or set plan.compile=false"))),
    Rule("plan.float8", (("plan.float8", ON),), {
        "cpu": Refused("float8 matmuls need an NVIDIA GPU with float8 tensor cores (L4, H100, H200, B200); on a CPU "
                       "they are emulated, slower than float32: set plan.float8=false"),
        **dict.fromkeys(XLA, Refused("is torchao's float8 training for CUDA GPUs, which torch_xla does not run; set "
                                     "plan.float8=false (bfloat16 is the TPU's fast path: plan.param_dtype=bfloat16)")),
        "flax": Refused("is torchao's float8 training for torch on CUDA GPUs; --backend flax has no float8 "
                        "matmuls: set plan.float8=false")}),
    Rule("plan.float8", (("plan.float8", ON), ("plan.tp_size", Above(1))), {
        "cuda": Refused("with plan.tp_size={plan.tp_size}: tensor-parallel float8 layers need torchao's float8 "
                        "tensor-parallel styles, which this lowering does not apply; set plan.float8=false or "
                        "plan.tp_size=1")}),
    Rule("plan.float8", (("plan.float8", ON), ("plan.compile", Is(False))), {
        "cuda": Caution("without plan.compile every float8 cast is a kernel of its own, which usually makes the "
                        "layers slower than in bfloat16; set plan.compile=true")}),
    # ---- backend-specific knobs on the other backends
    Rule("plan.cpu_collectives", (("plan.cpu_collectives", IsNot("auto")),), {
        "cuda": NoEffect("FSDP uses its device's collectives (NCCL)"),
        **dict.fromkeys(XLA, XLA_DECIDES), "flax": XLA_SCHEDULES}),
    Rule("plan.xla", (("plan.xla", ON),), {
        **dict.fromkeys(TORCH, NoEffect("it selects torch_xla, which is --backend xla")),
        "flax": NoEffect("it selects torch_xla, which is --backend xla")}),
    Rule("plan.xla_fsdp_settings", (("plan.xla_fsdp_settings", IsNot({})),), {
        **dict.fromkeys(TORCH, NoEffect("they are torch_xla's settings, read by --backend xla only")),
        "flax": NoEffect("they are torch_xla's settings, read by --backend xla only"),
        # compute_dtype and fp32_reduce_scatter became plan fields before this check (hf_import)
        "xla": NoEffect("{value}: options of torch_xla's FSDP v1 (XlaFullyShardedDataParallel), which SPMD FSDPv2 "
                        "does not take, so they are ignored as Hugging Face ignores them with xla_fsdp_v2 (its "
                        "compute_dtype and fp32_reduce_scatter became plan.param_dtype and plan.reduce_dtype); set "
                        "plan.xla_fsdp_v2=false to run FSDP v1 with them")}),
    # Trainer reads xla_fsdp_grad_ckpt on its XLA FSDP path only (xla: true), and warns otherwise.
    Rule("plan.xla_fsdp_grad_ckpt", (("plan.xla_fsdp_grad_ckpt", ON), ("plan.xla", Is(False))), dict.fromkeys(
        TARGETS, NoEffect("Hugging Face reads it only with xla: true (torch_xla's FSDP); set "
                          "plan.activation_checkpointing=true to recompute each layer, or plan.xla=true"))),
    Rule("plan.xla_fsdp_v2", (("plan.xla_fsdp_v2", Is(False)),), {
        **dict.fromkeys(TORCH, NoEffect("it chooses between torch_xla's FSDP versions, on --backend xla only")),
        "flax": NoEffect("it chooses between torch_xla's FSDP versions, on --backend xla only")}),
    Rule("plan.xla_fsdp_v2", (("plan.xla", ON), ("plan.xla_fsdp_v2", Is(False))), {
        "xla_v1": Caution("torch_xla's FSDP v1 (one process per device), which a Hugging Face fsdp_config with "
                          "xla: true runs unless it sets xla_fsdp_v2; SPMD FSDPv2 is recommended (one process per "
                          "host, every plan axis, the model built shard by shard): write \"xla_fsdp_v2\": true in "
                          "the file, or --config.plan.xla_fsdp_v2=true")}),
    # ---- where and how many (FSDP v1 runs one process per device)
    Rule("plan.xla_fsdp_v2", (("plan.xla_fsdp_v2", Is(False)), ("device", NoneOf(("cpu", "tpu")))), {
        "xla_v1": Refused("= false (FSDP v1) is launched on CPU and TPU only, not on PJRT device {device}; use "
                          "SPMD FSDPv2 (plan.xla_fsdp_v2=true)")}),
    Rule("--nproc", (("device", Is("cpu")), ("--nproc", Above(1))), {
        "xla_v1": Refused("{value}: FSDP v1 (plan.xla_fsdp_v2=false) runs one process per device, and "
                          "multi-process PJRT CPU collectives abort in torch_xla 2.9; use --nproc 1 on the CPU, or "
                          "SPMD FSDPv2 for several CPU devices (plan.xla_fsdp_v2=true; in a Hugging Face "
                          "fsdp_config \"xla_fsdp_v2\": true)")}),
    # ---- training fields a lowering does not have
    Rule("train.optimizer", (("train.optimizer", IsNot("adamw")), ("plan.state_dict_type", Is("FULL_STATE_DICT"))), {
        target: Caution("FULL checkpoints here keep the weights but not the optimizer's state (only "
                        "AdamW's moves between backends); a resume restarts it") for target in ("xla", "xla_v1", "flax")}),
    Rule("train.optimizer", (("train.optimizer", IsNot("adamw")), ("plan.state_dict_type", Is("SHARDED_STATE_DICT"))), {
        target: Refused("= {value}: SHARDED checkpoints on torch_xla hold AdamW's state only; use "
                        "plan.state_dict_type=FULL_STATE_DICT or train.optimizer=adamw") for target in XLA}),
    Rule("train.freeze", (("train.freeze", SET),), {
        "flax": Refused("frozen parameters are not available on --backend flax; use --backend cpu, cuda or xla, "
                        "or leave train.freeze empty")}),
    Rule("model.peft.type", (("model.peft.type", IsNot("")),), {
        target: Refused("= {value}: adapters are trained by --backend cpu or cuda only; use one of them, or leave "
                        "model.peft.type empty") for target in (*XLA, "flax")}),
    Rule("model.peft.type", (("model.peft.type", IsNot("")), ("plan.tp_size", Above(1))), dict.fromkeys(TORCH, Refused(
        "= {value} with plan.tp_size={plan.tp_size}: torch's tensor-parallel styles split plain Linear layers, not "
        "peft's adapted ones; set plan.tp_size=1 (FSDP shards the adapters with their layers)"))),
    Rule("model.peft.type", (("model.peft.type", IsNot("")), ("plan.float8", ON)), dict.fromkeys(TORCH, Refused(
        "= {value} with plan.float8: the float8 conversion does not look inside peft's adapted layers; set "
        "plan.float8=false"))),
    # ---- model families
    # What the model's own config.json decides, read as model.<name> (MODEL_FIELDS, from describe_model).
    Rule("model.model_type", (("model.model_type", NoneOf(FLAX_FAMILIES)),), {
        "flax": Refused("{value} is not implemented by --backend flax, which builds " + ", ".join(FLAX_FAMILIES)
                        + " models; train it with --backend cpu, cuda or xla")}),
    Rule("model.attention_dropout", (("plan.cp_size", Above(1)), ("model.attention_dropout", Above(0))), {
        "cpu": Refused(CP_DROPOUT)}),
    Rule("model.attention_dropout", (("model.attention_dropout", Above(0)),), {
        "flax": Refused("= {value} (the model's {model.attention_dropout_key}): the flax model applies no dropout; "
                        "set the model's {model.attention_dropout_key} to 0 in its config.json, or train it with "
                        "--backend cpu, cuda or xla")}),
    Rule("model.attention_dropout", (("plan.cp_size", Above(1)), ("plan.cp_impl", Is("portable")),
                                     ("model.attention_dropout", Above(0))), {"cuda": Refused(CP_DROPOUT)}),
    Rule("model.sliding_window", (("plan.cp_size", Above(1)), ("model.sliding_window", Shorter("data.seq_len"))), {
        **dict.fromkeys(TORCH, Refused(
            "= {value} (the model's sliding attention window) is shorter than data.seq_len={data.seq_len}, and "
            "context-parallel attention on --backend {target} attends to the whole causal prefix; set "
            "data.seq_len to at most {value}, or plan.cp_size=1 (--backend xla splits sequences with the model's "
            "own attention)"))}),
)


def target_for(backend: str, xla_fsdp_v2: bool = True) -> str:
    """The capability column a run uses: `xla` splits into SPMD FSDPv2 and FSDP v1."""
    return "xla_v1" if backend == "xla" and not xla_fsdp_v2 else backend


def verdicts(context: Mapping, target: str) -> list:
    """[(rule, verdict)] of every rule whose condition holds in `context` and that names `target` (a condition on
    a field `context` lacks — the model's, when the model is not known — does not hold)."""
    found = []
    for rule in RULES:
        verdict = rule.verdicts.get(target)
        if verdict is not None and all(name in context and cond.holds(context[name], context)
                                       for name, cond in rule.when):
            found.append((rule, verdict))
    return found


def message(rule: Rule, verdict, context: Mapping, target: str) -> str:
    """The verdict's text with `{value}` (the rule's field), `{target}`, `{device}` and `{a.dotted.field}`
    filled in."""
    text = verdict.fix if isinstance(verdict, Refused) else verdict.why
    fill = {**context, "value": context[rule.field], "target": target.replace("_v1", "")}
    return re.sub(r"\{([\w.\-]+)\}", lambda match: show(fill[match.group(1)]), text)


def markdown() -> str:
    """The table as docs/capabilities.md shows it: one row per rule, one column per target."""
    lines = ["# What each backend does with each setting", "",
             "Generated from `portable_fsdp/capabilities.py` (`python -m portable_fsdp.capabilities`); a setting "
             "that no row names is honoured on every backend. **refused** stops the run at start-up with one "
             "`error:` line naming the field and the fix; *no effect* and *with a warning* run with one warning.",
             "",
             "| setting | when | " + " | ".join(TARGET_NAMES[t] for t in TARGETS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in TARGETS) + " |"]
    for rule in RULES:
        when = ", ".join(f"`{name}` {cond.describe()}" for name, cond in rule.when)
        cells = []
        for target in TARGETS:
            verdict = rule.verdicts.get(target)
            if verdict is None:
                cells.append("honoured")
            elif isinstance(verdict, Refused):
                cells.append("**refused**")
            elif isinstance(verdict, Caution):
                cells.append(f"honoured, with a warning: {verdict.why}")
            else:
                cells.append(f"*no effect*: {verdict.why}")
        lines.append(f"| `{rule.field}` | {when} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
