"""The backend-neutral sharding plan: what to shard and how, with no framework imported.

Every backend lowers the same validated `ShardingPlan`; the field names are those Hugging Face
users already write in their `fsdp_config`.

Each plan field is declared once, here, with `setting(...)`: its default, its meaning, the values it takes,
and the keys of a Hugging Face `fsdp_config` / Accelerate `parallelism_config` that set it. The config
schema (`config.plan.*`, flat), the fsdp_config importer (hf_import.py) and `plan_from_config` are derived
from these declarations (`plan_fields()`).
"""
from __future__ import annotations

import dataclasses
import enum
import math

from portable_fsdp.backend import ModelInfo
from portable_fsdp.errors import UserError


class WrapPolicy(str, enum.Enum):
    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class StateDictType(str, enum.Enum):
    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"


DTYPES = ("float32", "bfloat16", "float16")


def setting(default, doc: str, *, hf: tuple = (), accelerate: tuple = (), choices: tuple = (),
            noun: str = "value"):
    """Declare one plan field. `hf`: the fsdp_config keys that set it (with or without the `fsdp_` prefix);
    `accelerate`: the ParallelismConfig keys (with or without `parallelism_config_`); `choices`: the values a
    string field takes (`noun` names them in the error)."""
    metadata = {"doc": doc, "hf": hf, "accelerate": accelerate, "choices": choices, "noun": noun}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the device-mesh axes. The world is dp_replicate × fsdp × cp|sp × tp, outermost first (tp ranks
    are neighbours, as they talk most); `fsdp_size=-1` takes whatever the others leave. `ep` is no axis of its
    own: as Hugging Face defines it, the experts of a MoE layer are split over ep ranks taken from fsdp × tp —
    ep_size / tp_size of the fsdp ranks (`ep_fsdp_size`) times every tp rank — so ep_size is a multiple of
    tp_size that divides fsdp_size × tp_size; the rest of the model is sharded over fsdp and split over tp as
    without ep. With tp_size 1 the ep ranks are fsdp ranks alone."""

    dp_replicate_size: int = setting(1, "HSDP: replicas of the sharded model; gradients are reduce-scattered in a "
                                        "replica and all-reduced across replicas; -1 = what the other axes leave "
                                        "of the world (with fsdp_size=1: DDP)", hf=("dp_replicate_size",),
                                     accelerate=("dp_replicate_size",))
    fsdp_size: int = setting(-1, "ranks parameters are sharded over; -1 = what the other axes leave of the world",
                             hf=("fsdp_size",), accelerate=("dp_shard_size", "fsdp_size"))
    cp_size: int = setting(1, "context parallelism: ranks one sequence is split over", accelerate=("cp_size",))
    tp_size: int = setting(1, "tensor parallelism: ranks one layer's weights are split over", hf=("tp_size",),
                           accelerate=("tp_size",))
    ep_size: int = setting(1, "expert parallelism: ranks the experts of a MoE layer are split over, taken from "
                              "fsdp × tp (a multiple of tp_size that divides fsdp_size × tp_size)", hf=("ep_size",),
                           accelerate=("ep_size",))
    sp_size: int = setting(1, "Ulysses sequence parallelism: ranks one sequence is split over, heads exchanged "
                              "around attention", accelerate=("sp_size",))

    def other_axes(self) -> dict:
        """The axes besides fsdp whose product with it is the world (ep lies inside fsdp)."""
        return {"dp_replicate_size": self.dp_replicate_size, "cp_size": self.cp_size, "sp_size": self.sp_size,
                "tp_size": self.tp_size}

    def resolve(self, world_size: int) -> "MeshSpec":
        """Infer `fsdp_size` (or `dp_replicate_size`) and check that the product of the axes is the world size."""
        sizes = {"fsdp_size": self.fsdp_size, "ep_size": self.ep_size, **self.other_axes()}
        for name, size in sizes.items():
            if size == 0 or size < -1 or (size == -1 and name not in ("fsdp_size", "dp_replicate_size")):
                raise UserError(f"plan.{name}", f"must be a positive integer (got {size})")
        if self.dp_replicate_size == -1:
            if self.fsdp_size == -1:
                raise UserError("plan.dp_replicate_size", "-1 infers the replicas from the world, which needs a "
                                "fixed plan.fsdp_size (e.g. 1: every rank a whole replica); set one of them")
            rest = self.fsdp_size * self.cp_size * self.sp_size * self.tp_size
            if world_size % rest:
                raise UserError("plan.dp_replicate_size", (
                    f"cannot infer: world size {world_size} is not divisible by fsdp*cp*sp*tp = {rest}; change the "
                    "mesh sizes or --nproc"))
            return dataclasses.replace(self, dp_replicate_size=world_size // rest).resolve(world_size)
        others = math.prod(self.other_axes().values())
        fsdp = self.fsdp_size
        product = "dp_replicate*cp*sp*tp"
        if fsdp == -1:
            if world_size % others:
                raise UserError("plan.fsdp_size", (
                    f"cannot infer: world size {world_size} is not divisible by {product} = {others}; change the "
                    "mesh sizes or --nproc"))
            fsdp = world_size // others
        if fsdp * others != world_size:
            raise UserError("plan.fsdp_size", (
                f"mesh dp_replicate*fsdp*cp*sp*tp = {self.dp_replicate_size}*{fsdp}*{self.cp_size}*{self.sp_size}"
                f"*{self.tp_size} = {fsdp * others} but the world size is {world_size}; set plan.fsdp_size=-1 to "
                "infer it or change --nproc"))
        resolved = dataclasses.replace(self, fsdp_size=fsdp)
        resolved.check_ep()
        return resolved

    def ep_sizes(self, num_experts: int = 0) -> list:
        """The ep sizes above 1 this (resolved) mesh takes — multiples of tp_size dividing fsdp_size × tp_size
        (transformers' rule: distributed/configuration_utils.py, DistributedConfig._validate_mesh_config) — and,
        given `num_experts`, that split the experts too."""
        ranks = self.fsdp_size * self.tp_size
        return [size for size in range(max(2, self.tp_size), ranks + 1, self.tp_size)
                if ranks % size == 0 and not (num_experts and num_experts % size)]

    def suggested_ep_size(self, num_experts: int = 0) -> int:
        """A working ep size for an error message: the largest of ep_sizes() up to ep_size, else the smallest,
        else 1 (no expert parallelism)."""
        sizes = self.ep_sizes(num_experts)
        return max([s for s in sizes if s <= self.ep_size] or sizes[:1] or [1])

    def check_ep(self) -> None:
        if self.ep_size == 1:
            return
        if self.ep_size % self.tp_size:
            raise UserError("plan.ep_size", (
                f"{self.ep_size} is not a multiple of tp_size={self.tp_size}: the experts are split over ep ranks "
                f"taken from fsdp × tp, every tp rank included; use e.g. plan.ep_size={self.suggested_ep_size()}"))
        if (self.fsdp_size * self.tp_size) % self.ep_size:
            raise UserError("plan.ep_size", (
                f"{self.ep_size} does not divide fsdp_size × tp_size = {self.fsdp_size}×{self.tp_size}: the experts "
                f"are split over ep ranks taken from fsdp × tp; use e.g. plan.ep_size={self.suggested_ep_size()}"))

    @property
    def ep_fsdp_size(self) -> int:
        """How many of the fsdp ranks one ep group spans (ep_size / tp_size; 1 without expert parallelism)."""
        return self.ep_size // self.tp_size if self.ep_size > 1 else 1

    @property
    def expert_fsdp_size(self) -> int:
        """Ranks that hold the same experts and shard them (Hugging Face's efsdp): fsdp_size / ep_fsdp_size."""
        return self.fsdp_size // self.ep_fsdp_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches (cp/sp/tp ranks share a batch)."""
        return self.dp_replicate_size * self.fsdp_size

    @property
    def sequence_size(self) -> int:
        """Ranks one sequence is split over (cp or sp; at most one of them is above 1)."""
        return self.cp_size * self.sp_size

    def axes(self) -> tuple:
        """(name, size) of every axis, outermost first: rank r's coordinates are r in this mixed radix."""
        return (("dp_replicate", self.dp_replicate_size), ("fsdp", self.fsdp_size), ("cp", self.cp_size),
                ("sp", self.sp_size), ("tp", self.tp_size))

    def coordinates(self, rank: int) -> dict:
        """{axis: index} of `rank` (a resolved spec)."""
        coords = {}
        for name, size in reversed(self.axes()):
            rank, coords[name] = divmod(rank, size)
        return coords

    def data_parallel_rank(self, rank: int) -> int:
        """Which slice of the global batch `rank` reads (replica-major, then fsdp)."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.fsdp_size + coords["fsdp"]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    param_dtype: str = setting("float32", "the dtype forward and backward compute in (float32 masters are kept)",
                               choices=DTYPES, noun="dtype")
    reduce_dtype: str = setting("float32", "the dtype gradients are reduced in", choices=DTYPES, noun="dtype")

    @property
    def enabled(self) -> bool:
        return (self.param_dtype, self.reduce_dtype) != ("float32", "float32")


@dataclasses.dataclass(frozen=True)
class XlaSettings:
    """Kept verbatim from a Hugging Face fsdp_config for the xla backend."""

    xla: bool = setting(False, "Hugging Face's switch to torch_xla's FSDP (--backend xla)", hf=("xla",))
    xla_fsdp_settings: dict = setting({}, "keyword arguments for torch_xla's FSDP (a mapping)",
                                      hf=("xla_fsdp_settings",))
    xla_fsdp_grad_ckpt: bool = setting(False, "Hugging Face's XLA spelling of activation_checkpointing, read with "
                                              "plan.xla=true only (as Hugging Face reads it)",
                                       hf=("xla_fsdp_grad_ckpt",))
    xla_fsdp_v2: bool = setting(True, "--backend xla: SPMD FSDPv2 (one process per host); false = FSDP v1 (one "
                                      "process per device), what a Hugging Face fsdp_config with xla: true and no "
                                      "xla_fsdp_v2 runs", hf=("xla_fsdp_v2",))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh: MeshSpec = MeshSpec()
    reshard_after_forward: bool = setting(True, "free gathered parameters after forward (FULL_SHARD) or keep them "
                                                "(SHARD_GRAD_OP)", hf=("reshard_after_forward",))
    cpu_offload: bool = setting(False, "parameters, gradients and optimizer state live on the CPU",
                                hf=("cpu_offload", "offload_params"))
    auto_wrap_policy: WrapPolicy = setting(WrapPolicy.TRANSFORMER_BASED_WRAP, "which modules become FSDP units",
                                           hf=("auto_wrap_policy",))
    transformer_layer_cls_to_wrap: tuple = setting((), "layer classes to wrap; empty = the model's "
                                                       "_no_split_modules", hf=("transformer_layer_cls_to_wrap",))
    min_num_params: int = setting(0, "SIZE_BASED_WRAP: parameters a unit holds at least", hf=("min_num_params",))
    state_dict_type: StateDictType = setting(StateDictType.FULL_STATE_DICT, "checkpoint layout",
                                             hf=("state_dict_type",))
    cpu_ram_efficient_loading: bool = setting(False, "only rank 0 builds/reads the weights; the others receive "
                                                     "a broadcast", hf=("cpu_ram_efficient_loading",))
    activation_checkpointing: bool = setting(False, "recompute each wrapped layer in backward",
                                             hf=("activation_checkpointing",))
    mixed_precision: MixedPrecision = MixedPrecision()
    cp_rotate_method: str = setting("allgather", "how K/V move round the cp group", accelerate=("cp_comm_strategy",),
                                    choices=("allgather", "alltoall"))
    cp_impl: str = setting("auto", "torch's context_parallel (CUDA) or the portable one; auto = torch on CUDA",
                           choices=("auto", "torch", "portable"))
    cp_load_balance: bool = setting(True, "head-tail chunks (even causal work); false = contiguous slices")
    tp_plan: dict = setting({}, "tensor-parallel plan, module pattern -> colwise | rowwise (transformers' "
                                "base_model_tp_plan notation); empty = the model's own base_model_tp_plan")
    cpu_collectives: str = setting("auto", "CPU ranks: FSDP's collectives through shared memory on one host "
                                           "(auto) or gloo's", choices=("auto", "gloo"))
    compile: bool = setting(False, "torch.compile each transformer layer (one graph per layer, compiled on the first "
                                   "step)")
    float8: bool = setting(False, "float8 matmuls (torchao) in every Linear layer but the lm_head (dims divisible by "
                                  "16), on GPUs with float8 tensor cores")
    xla: XlaSettings = XlaSettings()

    def validate(self, *, model_gradient_checkpointing: bool = False) -> None:
        """Checks that need nothing but the plan itself."""
        if self.mesh.cp_size > 1 and self.mesh.sp_size > 1:
            raise UserError("plan.cp_size", (
                f"context parallelism (cp_size={self.mesh.cp_size}) and Ulysses sequence "
                f"parallelism (sp_size={self.mesh.sp_size}) are alternatives; set one of them to 1"))
        if self.activation_checkpointing and model_gradient_checkpointing:
            raise UserError("plan.activation_checkpointing", (
                "is on together with train.gradient_checkpointing; they recompute the same activations "
                "twice: keep plan.activation_checkpointing and set train.gradient_checkpointing=false"))
        if self.auto_wrap_policy == WrapPolicy.SIZE_BASED_WRAP and self.min_num_params <= 0:
            raise UserError("plan.min_num_params", (
                "SIZE_BASED_WRAP needs a positive min_num_params (e.g. 100000000); "
                "set plan.min_num_params or choose another plan.auto_wrap_policy"))
        for field in plan_fields():
            value = field.value_in(self)
            if field.choices and value not in field.choices:
                raise UserError(f"plan.{field.name}", (
                    f"unknown {field.noun} {value!r}; choose one of {', '.join(field.choices)}"))

    def resolved_cp_impl(self, device_type: str) -> str:
        """`auto` takes torch's context_parallel on CUDA (its fused SDPA kernels), portable elsewhere; what a
        device cannot run is refused at start-up by the capability table (portable_fsdp/capabilities.py)."""
        return self.cp_impl if self.cp_impl != "auto" else ("torch" if device_type == "cuda" else "portable")

    def wrap_classes(self, model: ModelInfo) -> tuple:
        """The layer classes to wrap: the plan's, or the model's own `_no_split_modules` when empty. A class the
        model does not have, the model itself, or a class inside another wrapped class is a UserError naming
        the classes the model does have (its _no_split_modules first)."""
        wanted = tuple(self.transformer_layer_cls_to_wrap) or tuple(model.no_split_modules)
        needed = (self.auto_wrap_policy == WrapPolicy.TRANSFORMER_BASED_WRAP or self.activation_checkpointing
                  or self.compile)
        field = "plan.transformer_layer_cls_to_wrap"
        if not wanted and needed:
            raise UserError(field, (
                "is empty and the model declares no _no_split_modules; name the layer class to wrap "
                f"(module classes in this model: {', '.join(model.class_names)})"))
        missing = [name for name in wanted if name not in model.class_names]
        if missing:
            raise UserError(field, f"the model has no class {', '.join(missing)}; {_classes_it_has(model)}")
        if model.root_class in wanted:
            raise UserError(field, (
                f"{model.root_class} is the whole model: one unit gathers every parameter at once and saves no "
                f"memory; wrap its layers instead ({_classes_it_has(model)}), or set plan.auto_wrap_policy=NO_WRAP"))
        nested = [(outer, inner) for outer in wanted for inner in wanted
                  if outer != inner and inner in model.inner_classes.get(outer, ())]
        if nested:
            outer, inner = nested[0]
            raise UserError(field, (
                f"{outer} contains {inner}: a unit inside another unit is gathered twice; name one of them "
                f"({_classes_it_has(model)})"))
        return wanted

    def wrap_warnings(self, model: ModelInfo) -> list:
        """What runs but costs: a wrapped class that holds no other module (Linear, Embedding, ...) makes every
        such layer its own unit, each with its own all-gather and reduce-scatter per step."""
        if self.auto_wrap_policy != WrapPolicy.TRANSFORMER_BASED_WRAP:
            return []
        single = [name for name in self.wrap_classes(model) if not model.inner_classes.get(name)]
        layers = ", ".join(model.no_split_modules) or "a transformer layer class"
        return [f"plan.transformer_layer_cls_to_wrap: {name} holds no other module, so every {name} becomes its "
                f"own FSDP unit with its own all-gather and reduce-scatter each step: far more communication than "
                f"wrapping {layers}" for name in single]


def _classes_it_has(model: ModelInfo) -> str:
    """The model's classes for an error message: its _no_split_modules first, then its other layer-like ones."""
    layer_like = [c for c in model.class_names if ("Layer" in c or "Block" in c) and c not in model.no_split_modules]
    return "classes it has: " + ", ".join([*model.no_split_modules, *layer_like] or model.class_names)


@dataclasses.dataclass(frozen=True)
class PlanField:
    """One declared plan field, flattened: `config.plan.<name>` is `ShardingPlan.<path>`."""

    name: str
    path: tuple
    default: object
    doc: str
    hf_keys: tuple
    accelerate_keys: tuple
    choices: tuple
    noun: str

    def value_in(self, plan) -> object:
        for attribute in self.path:
            plan = getattr(plan, attribute)
        return plan

    @property
    def config_default(self):
        """The default as the config holds it: an enum by its name, a tuple as a list, a mapping as a dict."""
        if isinstance(self.default, enum.Enum):
            return self.default.value
        if isinstance(self.default, tuple):
            return list(self.default)
        return self.default

    def from_config(self, value):
        """The config's value as the plan holds it (the config's types were checked when it was set)."""
        field = f"plan.{self.name}"
        if isinstance(self.default, enum.Enum):
            return parse_enum(type(self.default), value, field)
        if isinstance(self.default, tuple):
            return as_class_list(value, field)
        if isinstance(self.default, dict):
            return dict(value.to_dict() if hasattr(value, "to_dict") else value)
        return value


def _leaves(cls, prefix: tuple = ()):
    for field in dataclasses.fields(cls):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            yield from _leaves(type(default), (*prefix, field.name))
        else:
            meta = field.metadata
            yield PlanField(field.name, (*prefix, field.name), default, meta["doc"], meta["hf"], meta["accelerate"],
                            meta["choices"], meta["noun"])


def plan_fields() -> tuple:
    """Every plan field, in declaration order."""
    return tuple(_leaves(ShardingPlan))


def build(cls, values: dict, prefix: tuple = ()):
    """A `cls` (ShardingPlan or one of its parts) from {flat name: plan value}."""
    kwargs = {}
    for field in dataclasses.fields(cls):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            kwargs[field.name] = build(type(default), values, (*prefix, field.name))
        elif field.name in values:
            kwargs[field.name] = values[field.name]
    return cls(**kwargs)


def parse_enum(enum_type, value, field: str):
    try:
        return enum_type(str(value).upper())
    except ValueError:
        choices = ", ".join(member.value for member in enum_type)
        raise UserError(field, f"unknown value {value!r}; choose one of {choices}") from None


def as_class_list(value, field: str) -> tuple:
    """HF accepts one class name, a comma-separated string, or a list."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise UserError(field, f"must be a class name or a list of class names (got {value!r})")
