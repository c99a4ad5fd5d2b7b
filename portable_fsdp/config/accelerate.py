"""The launch half of an Accelerate YAML: how many processes, on how many machines, meeting where — read into
`LaunchSettings`, with the command line winning (`--nproc`, `--backend`). The FSDP half (`fsdp_config`,
`mixed_precision`, `parallelism_config`) is hf_import's.

Every top-level key is accounted for: honoured, refused with one `error:` line naming what to write instead,
or — when it asks for something this launcher does not do — one warning naming it and why. A key at the value
that asks for nothing (`debug: false`, `tpu_env: []`, `same_network: true`, ...) is accepted silently."""
from __future__ import annotations

import dataclasses
import pathlib
import warnings

from portable_fsdp import backends
from portable_fsdp.config.hf_import import load_yaml
from portable_fsdp.errors import Notice, UserError
from portable_fsdp.launch import cluster

# Read by hf_import.apply_accelerate_yaml.
PLAN_KEYS = ("fsdp_config", "mixed_precision", "parallelism_config", "use_parallelism_config")
# Decided by torchrun when the command runs under it.
PROCESS_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                "rdzv_backend")
RDZV_BACKENDS = ("static", "c10d")
ACCEPTED_TYPES = ("FSDP", "MULTI_GPU", "MULTI_CPU", "NO", "XLA", "TPU")  # TPU: Accelerate's old name for XLA
# Keys this launcher does not act on: (the values that ask for nothing, why it is ignored otherwise).
_TPU = "Accelerate's TPU-pod launcher setting; start the command on each TPU host yourself"
IGNORED_KEYS = {
    "debug": ((False, None), "portable_fsdp has no debug launch mode; set TORCH_DISTRIBUTED_DEBUG=DETAIL for torch's checks"),
    "downcast_bf16": (("no", False, None), "a torch_xla bf16 downcast of Accelerate's; set mixed_precision or plan.param_dtype"),
    "enable_cpu_affinity": ((False, None), "workers are not pinned to CPU cores by this launcher"),
    "same_network": ((True, None), "the rendezvous only needs main_process_ip:main_process_port reachable from every machine"),
    "main_training_function": (("main", None), "the command trains the recipe given by --config; there is no function to call"),
    "gpu_ids": (("all", None), "this launcher does not restrict devices (untested without GPUs); run the command with "
                               "CUDA_VISIBLE_DEVICES set instead"),
    "dynamo_backend": (("no", "NO", None), "torch.compile is not applied by portable_fsdp"),
    **{key: ((False, None, ""), _TPU) for key in (
        "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file", "commands")},
    **{key: ((None,), "a section portable_fsdp does not read") for key in (
        "deepspeed_config", "megatron_lm_config", "fp8_config", "ipex_config", "mpirun_config", "dynamo_config")},
}


class IgnoredKey(Notice):
    """A key of the file that is read but not acted on; the command prints it as one `warning:` line."""


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """What the launcher takes from the file and the command line together. `nproc`: local worker processes
    (None: the backend's default). One machine unless `num_machines` > 1: then every machine's launcher joins one
    rendezvous at `main_process_ip:main_process_port` (`rdzv_backend` static: `machine_rank` is the node rank,
    and machine 0 hosts the store; c10d: the rendezvous assigns node ranks). On flax each machine's launcher is
    one JAX process, `machine_rank` of `num_machines`, and the coordinator is at that address (static only)."""

    backend: str = "auto"
    nproc: int | None = None
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "static"

    @property
    def multi_node(self) -> bool:
        return self.num_machines > 1


def from_file(path: str | None, backend: str = "auto", nproc: int | None = None, torchrun: bool = False,
              scheduler: cluster.Machines | None = None) -> LaunchSettings:
    """The settings for `--fsdp_config path` (a JSON, or no file: the command line's alone) on the machines a
    scheduler reports (`scheduler`, see launch.cluster)."""
    if path is None or pathlib.Path(path).suffix not in (".yaml", ".yml"):
        return _checked(cluster.joined(LaunchSettings(backend=backend, nproc=nproc), scheduler),
                        scheduler and scheduler.count_variable)
    return settings(load_yaml(pathlib.Path(path).read_text(), path), path, backend, nproc, torchrun, scheduler)


def settings(data: dict, path: str, backend: str = "auto", nproc: int | None = None,
             torchrun: bool = False, scheduler: cluster.Machines | None = None) -> LaunchSettings:
    """An Accelerate YAML's top-level mapping + the command line's `--backend` and `--nproc` -> LaunchSettings,
    on the machines a scheduler reports (`scheduler`; a num_machines the file writes must agree). Refusals raise
    UserError naming `path: key`; ignored keys warn (IgnoredKey), once each."""
    _check_environment(data, path)
    backend = _backend(data, path, backend)
    _warn_ignored(data, path)
    if torchrun:
        present = [key for key in PROCESS_KEYS if data.get(key) is not None]
        if present:
            _warn(path, ", ".join(present), "torchrun decides the processes and the rendezvous")
        return LaunchSettings(backend=backend, nproc=nproc)
    machines = _positive_int(data, "num_machines", path, 1)
    rank = data.get("machine_rank") or 0
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < machines:
        raise UserError(f"{path}: machine_rank", f"must be an integer from 0 to num_machines - 1 = {machines - 1} "
                        f"(got {rank!r})")
    total = _positive_int(data, "num_processes", path, None)
    if nproc is None and total is not None:
        if total % machines:
            raise UserError(f"{path}: num_processes", (
                f"{total} processes do not divide over num_machines = {machines} (Accelerate counts the processes "
                "of all machines); set num_processes to a multiple of num_machines"))
        nproc = total // machines
    rdzv = data.get("rdzv_backend") or "static"
    if rdzv not in RDZV_BACKENDS:
        raise UserError(f"{path}: rdzv_backend", f"{rdzv!r} is not supported; choose static (Accelerate's default) or c10d")
    ip, port = data.get("main_process_ip"), data.get("main_process_port")
    if ip is not None and not isinstance(ip, str):
        raise UserError(f"{path}: main_process_ip", f"must be an address such as 10.0.0.1 (got {ip!r})")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise UserError(f"{path}: main_process_port", f"must be a port number (got {port!r})")
    if machines > 1:
        if not ip:
            raise UserError(f"{path}: main_process_ip", (
                f"num_machines: {machines} needs main_process_ip, the address of the machine with machine_rank 0"))
        port = port or 29500  # Accelerate's and torchrun's default
    elif ip is not None:
        _warn(path, "main_process_ip", "with num_machines: 1 the workers meet on 127.0.0.1")
    if machines > 1 and rdzv == "c10d" and rank:
        _warn(path, "machine_rank", "with rdzv_backend c10d the rendezvous assigns node ranks (write static to keep it)")
    settings = LaunchSettings(backend=backend, nproc=nproc, num_machines=machines, machine_rank=rank,
                              main_process_ip=ip, main_process_port=port, rdzv_backend=rdzv)
    return _checked(cluster.joined(settings, scheduler, data.get("num_machines"), path), path)


def _checked(settings: LaunchSettings, path: str | None) -> LaunchSettings:
    """`settings` once the backend, when it is known, accepts its machines (auto: by the command, once resolved)."""
    if settings.multi_node and settings.backend != "auto":
        backends.load(settings.backend).check_machines(settings, path)
    return settings


def _check_environment(data: dict, path: str) -> None:
    environment = data.get("compute_environment") or "LOCAL_MACHINE"
    if environment != "LOCAL_MACHINE":
        raise UserError(f"{path}: compute_environment", (
            f"{environment} is not launched by portable_fsdp; write compute_environment: LOCAL_MACHINE and start "
            "the command on each machine"))


def _backend(data: dict, path: str, backend: str) -> str:
    """`--backend` unless it is auto: then distributed_type XLA picks xla, use_cpu (or MULTI_CPU) picks cpu."""
    kind = str(data.get("distributed_type") or "NO").upper()
    if kind not in ACCEPTED_TYPES:
        raise UserError(f"{path}: distributed_type", (
            f"{kind} is not run by portable_fsdp; write distributed_type: FSDP (with the fsdp_config section), "
            "or XLA for torch_xla"))
    use_cpu = data.get("use_cpu") or False
    if not isinstance(use_cpu, bool):
        raise UserError(f"{path}: use_cpu", f"must be true or false (got {use_cpu!r})")
    wanted = "xla" if kind in ("XLA", "TPU") else "cpu" if use_cpu or kind == "MULTI_CPU" else None
    if backend != "auto":
        if wanted and wanted != backend:
            key = "distributed_type" if kind in ("XLA", "TPU", "MULTI_CPU") else "use_cpu"
            _warn(path, key, f"--backend {backend} on the command line wins")
        return backend
    return wanted or "auto"


def _warn_ignored(data: dict, path: str) -> None:
    known = {*PLAN_KEYS, *PROCESS_KEYS, *IGNORED_KEYS, "compute_environment", "distributed_type", "use_cpu"}
    for key, value in data.items():
        if key not in known:
            _warn(path, key, "not an Accelerate setting portable_fsdp knows")
        elif key in IGNORED_KEYS:
            no_op, why = IGNORED_KEYS[key]
            if not _asks_nothing(value, no_op):
                _warn(path, key, why)


def _asks_nothing(value, no_op) -> bool:
    """An empty list or mapping, or one of `no_op` (of the same type: 1 is not True)."""
    if isinstance(value, (list, dict)):
        return not value
    return any(value == v and type(value) is type(v) for v in no_op)


def _positive_int(data: dict, key: str, path: str, default):
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{path}: {key}", f"must be a positive integer (got {value!r})")
    return value


def _warn(path: str, key: str, why: str) -> None:
    warnings.warn(f"{path}: {key} is ignored: {why}", IgnoredKey, stacklevel=3)
