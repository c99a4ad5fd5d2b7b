"""One place for what differs between the two torch_xla execution models, so the step reads the same for both:

SPMD (FSDPv2): one process per host drives every device of the mesh; tensors are global and sharded, and
    the XLA compiler inserts the collectives. Reductions over devices are implicit. On a TPU slice of several
    hosts each host feeds its own rows of the batch, and host numbers meet over a gloo group (torch_xla's
    documented way: its `xla` process group does not run under SPMD, docs/source/perf/spmd_distributed_checkpoint.md).
FSDP v1: one process per device (torch_xla's launcher); tensors are local, and sums over processes are
    explicit `xm.all_reduce`s.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import numpy as np
import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as xla_metrics
import torch_xla.distributed.spmd as xs
import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// init method of the hosts' gloo group
import torch_xla.runtime as xr

from portable_fsdp import placement
from portable_fsdp.backends.xla import layout
from portable_fsdp.errors import UserError
from portable_fsdp.plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class Runtime:
    spmd: bool
    device: torch.device
    device_type: str  # "CPU", "TPU", ...
    mesh: object | None  # xs.Mesh over every device (SPMD); None for v1
    rank: int  # SPMD: process (host) index; v1: global ordinal
    world_size: int  # SPMD: devices of the mesh; v1: processes (one per device)
    process_count: int
    data_parallel: tuple  # (dp_rank, dp_size): which slice of the global batch this process feeds, of how many


def initialize(plan: ShardingPlan, timeout_s: float) -> Runtime:
    """`timeout_s` (train.collective_timeout_s) bounds every wait of the hosts' gloo group: a lost host is an error,
    not a hang."""
    if plan.xla.xla_fsdp_v2:
        if not xr.is_spmd():
            xr.use_spmd()  # before any tensor reaches a device
        devices = xr.global_runtime_device_count()
        # On a TPU the launcher counted the slice's devices from its metadata, before the runtime started
        counted = int(os.environ.get("WORLD_SIZE", devices)) if xr.device_type() != "CPU" else devices
        if devices != counted:
            raise UserError("--nproc", f"xla: torch_xla's runtime has {devices} devices where {counted} were counted "
                            "before it started (the TPU's topology settings changed?); set them back or restart")
        # One mesh for every axis of the plan, outermost first (portable_fsdp/placement.py): tp devices are
        # neighbours, as are the devices one sequence is split over.
        spec = plan.mesh.resolve(devices)
        mesh = xs.Mesh(np.arange(devices), layout.mesh_shape(spec), placement.MESH_AXES)
        xs.set_global_mesh(mesh)
        hosts = xr.process_count()
        data_slice = _host_data_slice(devices) if hosts > 1 else (0, 1)
        if hosts > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", init_method="xla://",  # rank: xr.process_index(), one per host
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return Runtime(True, torch_xla.device(), xr.device_type(), mesh, xr.process_index(), devices, hosts,
                       data_slice)
    return Runtime(False, torch_xla.device(), xr.device_type(), None, xr.global_ordinal(), xr.world_size(),
                   xr.world_size(), (xr.global_ordinal(), xr.world_size()))


def _host_data_slice(devices: int) -> tuple:
    """This host's rows of the global batch (placement.host_data_slice) over the devices its process drives, each
    device a row of its own (launch.check_slice_plan)."""
    mine = [int(device.rsplit(":", 1)[1]) for device in torch_xla._XLAC._xla_get_runtime_devices()]
    return placement.host_data_slice(mine, devices, devices, "plan.fsdp_size")


class _PartialShardingSpec(xs.ShardingSpec):
    """torch_xla 2.9's ShardingSpec takes a spec that names a mesh axis for every dimension as fully tiled even
    when the mesh has axes the spec leaves out (a batch is not split over tp, nor over axes of size 1), and the
    transfer fails ("too many indices"); take the tiling, replication groups and type from the mesh, as
    `mark_sharding` does."""

    def __post_init__(self):
        (self._tile_assignment, self._group_assignment, self._replication_groups,
         self._sharding_type) = self.mesh._get_op_sharding_args(tuple(self.partition_spec))


def batch_sharding(runtime: Runtime):
    """[batch, sequence] arrays: rows over the data-parallel axes, tokens over cp|sp (layout.activation_spec);
    with several hosts each feeds its own rows (torch_xla's `minibatch`)."""
    return _PartialShardingSpec(runtime.mesh, layout.activation_spec(2), minibatch=runtime.process_count > 1)


def to_device_sharded(mesh, tensor: torch.Tensor, spec: tuple) -> torch.Tensor:
    """A host tensor on the SPMD device, sharded by `spec` over `mesh`: each device is sent only its shard, cut
    from `tensor` (a view where the split is along dimension 0), with no device-side copy of the whole."""
    (moved,) = xm.send_cpu_data_to_device([tensor], torch_xla.device(), _PartialShardingSpec(mesh, spec))
    return moved


def to_device(runtime: Runtime, arrays: list) -> list:
    """Host int64 arrays -> device tensors, sharded by row under SPMD, in one transfer, no pinned memory."""
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    sharding = batch_sharding(runtime) if runtime.spmd else None
    return xm.send_cpu_data_to_device(tensors, runtime.device, sharding)


def device_sum(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over every device: SPMD tensors already are global; v1 sums over processes."""
    return tensor if runtime.spmd else xm.all_reduce(xm.REDUCE_SUM, tensor)


def host_sum(runtime: Runtime, value: float) -> float:
    """A Python number summed over processes: FSDP v1's (one per device), or several SPMD hosts' (gloo)."""
    if runtime.process_count == 1:
        return value
    if runtime.spmd:
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total.item())
    return float(xm.mesh_reduce("portable_fsdp.host_sum", value, sum))


def gather_rows(runtime: Runtime, tensor: torch.Tensor) -> np.ndarray:
    """Every row of a batch-sharded tensor, in global-batch order, on the host of every process."""
    if runtime.spmd:
        if runtime.process_count > 1:
            raise UserError("train.compute_metrics", (
                "needs every prediction on one host, and SPMD FSDPv2 over several hosts keeps each host's rows "
                "on its own devices; leave train.compute_metrics empty (eval_loss is still computed) or run "
                "FSDP v1 (plan.xla_fsdp_v2=false)"))
        return tensor.cpu().numpy()
    return xm.all_gather(tensor, dim=0).cpu().numpy()


def barrier(runtime: Runtime, tag: str = "portable_fsdp") -> None:
    if runtime.process_count == 1:
        return
    if runtime.spmd:
        dist.barrier()
    else:
        xm.rendezvous(tag)


def sync() -> None:
    """Cut the traced graph here and run it: the unit the compilation cache works on."""
    torch_xla.sync()


def compilations() -> tuple:
    """(graphs compiled so far, seconds spent compiling) from torch_xla's metrics."""
    data = xla_metrics.metric_data("CompileTime")
    if data is None:
        return 0, 0.0
    count, total_ns = data[0], data[1]
    return int(count), total_ns / 1e9
