"""The backend-neutral sharding plan: what to shard and how, with no framework imported.

Every backend lowers the same validated `ShardingPlan`; the field names are those Hugging Face
users already write in their `fsdp_config`.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

from portable_fsdp.errors import UserError


class WrapPolicy(str, enum.Enum):
    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class StateDictType(str, enum.Enum):
    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"


DTYPES = ("float32", "bfloat16", "float16")
CP_ROTATE_METHODS = ("allgather", "alltoall")
CP_IMPLS = ("auto", "torch", "portable")
CPU_COLLECTIVES = ("auto", "gloo")

# Mesh axes a backend cannot honour yet, and the product issue each waits for.
UNBUILT_AXES = {
    "tp_size": "tensor parallelism",
    "ep_size": "expert parallelism for MoE models",
    "sp_size": "Ulysses sequence parallelism",
}


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the device-mesh axes; `fsdp_size=-1` takes whatever the others leave."""

    fsdp_size: int = -1
    cp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    sp_size: int = 1

    def other_axes(self) -> dict:
        return {"cp_size": self.cp_size, "tp_size": self.tp_size,
                "ep_size": self.ep_size, "sp_size": self.sp_size}

    def resolve(self, world_size: int) -> "MeshSpec":
        """Infer `fsdp_size` and check that the product of all axes is the world size."""
        for name, size in {"fsdp_size": self.fsdp_size, **self.other_axes()}.items():
            if size == 0 or size < -1 or (size == -1 and name != "fsdp_size"):
                raise UserError(f"plan.{name}", f"must be a positive integer (got {size})")
        others = math.prod(self.other_axes().values())
        fsdp = self.fsdp_size
        if fsdp == -1:
            if world_size % others:
                raise UserError("plan.fsdp_size", (
                    f"cannot infer: world size {world_size} is not divisible by "
                    f"cp*tp*ep*sp = {others}; change the mesh sizes or --nproc"))
            fsdp = world_size // others
        if fsdp * others != world_size:
            raise UserError("plan.fsdp_size", (
                f"mesh fsdp*cp*tp*ep*sp = {fsdp}*{self.cp_size}*{self.tp_size}*{self.ep_size}"
                f"*{self.sp_size} = {fsdp * others} but the world size is {world_size}; "
                "set plan.fsdp_size=-1 to infer it or change --nproc"))
        return dataclasses.replace(self, fsdp_size=fsdp)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches (cp/tp/sp ranks share a batch)."""
        return self.fsdp_size * self.ep_size


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"

    @property
    def enabled(self) -> bool:
        return (self.param_dtype, self.reduce_dtype) != ("float32", "float32")


@dataclasses.dataclass(frozen=True)
class XlaSettings:
    """Kept verbatim from a Hugging Face fsdp_config for the xla backend."""

    xla: bool = False
    xla_fsdp_settings: dict = dataclasses.field(default_factory=dict)
    xla_fsdp_grad_ckpt: bool = False
    xla_fsdp_v2: bool = True  # SPMD FSDPv2; False = XlaFullyShardedDataParallel (FSDP v1)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh: MeshSpec = MeshSpec()
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    auto_wrap_policy: WrapPolicy = WrapPolicy.TRANSFORMER_BASED_WRAP
    transformer_layer_cls_to_wrap: tuple = ()
    min_num_params: int = 0
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    mixed_precision: MixedPrecision = MixedPrecision()
    cp_rotate_method: str = "allgather"  # how K/V move round the cp group: allgather | alltoall (ring)
    cp_impl: str = "auto"  # auto (torch on CUDA, portable elsewhere) | torch | portable
    cp_load_balance: bool = True  # head-tail chunks (even causal work); False = contiguous slices
    cpu_collectives: str = "auto"  # CPU ranks: auto (shared memory on one host) | gloo (its TCP collectives)
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
        if self.cp_rotate_method not in CP_ROTATE_METHODS:
            raise UserError("plan.cp_rotate_method", (
                f"unknown value {self.cp_rotate_method!r}; choose one of {', '.join(CP_ROTATE_METHODS)}"))
        if self.cp_impl not in CP_IMPLS:
            raise UserError("plan.cp_impl", f"unknown value {self.cp_impl!r}; choose one of {', '.join(CP_IMPLS)}")
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise UserError("plan.cpu_collectives", (
                f"unknown value {self.cpu_collectives!r}; choose one of {', '.join(CPU_COLLECTIVES)}"))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self.mixed_precision, name)
            if value not in DTYPES:
                raise UserError(f"plan.{name}", f"unknown dtype {value!r}; choose one of {', '.join(DTYPES)}")

    def resolved_cp_impl(self, device_type: str) -> str:
        """`auto` takes torch's context_parallel on CUDA (its fused SDPA kernels), portable elsewhere."""
        impl = self.cp_impl if self.cp_impl != "auto" else ("torch" if device_type == "cuda" else "portable")
        if impl == "torch" and not self.cp_load_balance:
            raise UserError("plan.cp_load_balance", (
                "= false is not supported by cp_impl=torch (torch's context_parallel always splits head-tail); "
                "use plan.cp_impl=portable or keep plan.cp_load_balance=true"))
        if impl == "torch" and device_type != "cuda":
            raise UserError("plan.cp_impl", (
                f"torch's context_parallel needs CUDA SDPA kernels and cannot run on {device_type}; "
                "use plan.cp_impl=portable (or auto)"))
        return impl

    def check_buildable(self) -> None:
        """Refuse, instead of ignoring, what no backend built so far can honour."""
        for name, size in self.mesh.other_axes().items():
            if size > 1 and name in UNBUILT_AXES:
                raise UserError(f"plan.{name}", (
                    f"{size} needs {UNBUILT_AXES[name]}, which is not built yet (no product issue covers it so "
                    f"far); set plan.{name}=1"))

    def wrap_classes(self, model_no_split: Sequence[str], model_classes: Sequence[str]) -> tuple:
        """The layer classes to wrap: the plan's, or the model's own `_no_split_modules` when empty."""
        wanted = tuple(self.transformer_layer_cls_to_wrap) or tuple(model_no_split)
        needed = self.auto_wrap_policy == WrapPolicy.TRANSFORMER_BASED_WRAP or self.activation_checkpointing
        if not wanted and needed:
            raise UserError("plan.transformer_layer_cls_to_wrap", (
                "is empty and the model declares no _no_split_modules; name the layer class to wrap "
                f"(module classes in this model: {', '.join(sorted(set(model_classes)))})"))
        missing = [name for name in wanted if name not in model_classes]
        if missing:
            layers = sorted({c for c in model_classes if "Layer" in c or "Block" in c}) or sorted(set(model_classes))
            raise UserError("plan.transformer_layer_cls_to_wrap", (
                f"the model has no class {', '.join(missing)}; classes it has: {', '.join(layers)}"))
        return wanted


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
