"""`python -m portable_fsdp.estimate --config RECIPE[:variant] [--nproc N] [--backend cpu|cuda|xla|flax]
[--device h100|h200|a100|a100-40|v4|v5e|v5p|v6e|cpu] [--mfu 0.4] [--config.a.b=v ...]`

Will a run fit, before it starts? Per rank: parameters, gradients and optimizer state, the activations and
the gathered (all-gathered) weights at the step's peak, against the device's memory; the FLOPs of a step and
its time at a stated MFU. Needs no accelerator: the lowering's own start-up runs on fake tensors
(cpu, cuda: torch FSDP2 traced over a fake process group; flax: the jitted step compiled for abstract inputs;
xla: an analytical estimate — see docs/estimate.md).

Exit status: 0 it fits; 1 it does not, and the last line names settings that would (each tried here); 2 a bad
input (one `error:` line); 3 the estimate itself failed.

The framework work runs in a separate process (`serve`), so this module imports no framework and the fake
process group never meets a real one.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from portable_fsdp import backends, hardware, tpu_vm
from portable_fsdp.backend import ModelInfo
from portable_fsdp.cli import Parser, config_overrides
from portable_fsdp.config import DEFAULT_RECIPE, apply_override, from_dict, load_recipe
from portable_fsdp.errors import UserError
from portable_fsdp.metrics import flops_per_token
from portable_fsdp.validate import resolve_plan

HEADROOM = 0.10  # of each device's memory, left for what is not modelled (allocator, CUDA context, NCCL buffers)
ESTIMATE_FAILED = 3
ROWS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
        ("activations", "activations"), ("program_temporaries", "activations, temporaries"),
        ("gathered", "gathered parameters"),
        ("unsharded_gradients", "unsharded gradients"), ("temporaries", "temporaries"),
        ("inputs", "program inputs"), ("outputs", "program outputs"))
HELD = ("parameters", "gradients", "optimizer")


# ---------------------------------------------------------------------------------------------- the target


@dataclasses.dataclass(frozen=True)
class Target:
    """What the run trains on: the backend, how many ranks, and one rank's device."""

    backend: str
    nproc: int
    device: str  # a hardware.DEVICE_MEMORY key, "cpu" (host memory), or "detected"
    label: str  # the device as its framework names it (DATASHEET matches it)
    memory: int  # bytes one rank may use (host memory: its share)
    headroom: float = HEADROOM

    @property
    def usable(self) -> float:
        return self.memory * (1.0 - self.headroom)

    @property
    def device_type(self) -> str:
        """What the capability table calls the device (cpu, cuda, tpu, gpu)."""
        if self.device == "cpu":
            return "cpu"
        return trained_as(self.backend, self.label) or device_kind(self.label)

    def with_nproc(self, nproc: int) -> "Target":
        if self.device == "cpu":  # ranks of one host share its memory
            return dataclasses.replace(self, nproc=nproc, memory=self.memory * self.nproc // nproc)
        return dataclasses.replace(self, nproc=nproc)


def tpu_from_environment() -> str | None:
    """The --device name of this Cloud TPU VM's chips, from its accelerator type (v4-8, v5litepod-16, v5p-8,
    v6e-8: TPU_ACCELERATOR_TYPE, else the VM's metadata), or None."""
    kind = tpu_vm.accelerator_type().lower()
    for prefix, name in (("v5litepod", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v6e", "v6e"), ("v4", "v4")):
        if kind.startswith(prefix):
            return name
    return None


def device_kind(label: str) -> str:
    """A datasheet device's kind: "tpu" or "gpu"."""
    return "tpu" if label.startswith("TPU") else "gpu"


def trained_as(backend: str, label: str) -> str | None:
    """The device kind `backend` trains the device `label` as (`Backend.estimate_devices`: a GPU is "cuda" to
    the torch lowering, "gpu" to JAX), or None when it does not train on it."""
    kinds = backends.load(backend).estimate_devices(backend)
    kind = device_kind(label)
    return next((k for k in kinds if k == kind or (kind == "gpu" and k == "cuda")), None)


def resolve_target(backend: str, device: str, nproc: int | None) -> Target:
    """`device`: a DEVICE_MEMORY key, "cpu" for host memory, or "auto" (the backend's first device kind: the
    visible GPU on cuda, the TPU that TPU_ACCELERATOR_TYPE names on xla, host memory on cpu and flax)."""
    device = device.lower()
    if device == "auto":
        first = backends.load(backend).estimate_devices(backend)[0]
        device = {"cuda": "detected", "tpu": tpu_from_environment() or "unknown"}.get(first, "cpu")
        if device == "unknown":
            raise UserError("--device", "cannot tell which TPU this run trains on (TPU_ACCELERATOR_TYPE is not set); "
                            f"name it: --device {{{','.join(k for k in hardware.DEVICE_MEMORY if k[0] == 'v')}}}")
    if device == "detected":
        label, memory, visible = _visible_gpu()
        return Target(backend, nproc or visible, device, label, memory)
    nproc = nproc or (2 if device == "cpu" else 1)
    if device == "cpu":
        import psutil

        return Target(backend, nproc, "cpu", "cpu", psutil.virtual_memory().total // nproc)
    if device not in hardware.DEVICE_MEMORY:
        raise UserError("--device", f"unknown device {device!r}; choose one of "
                        f"{', '.join([*hardware.DEVICE_MEMORY, 'cpu'])}")
    label, memory = hardware.DEVICE_MEMORY[device]
    if trained_as(backend, label) is None:
        kinds = backends.load(backend).estimate_devices(backend)
        others = " or ".join(f"--backend {b}" for b in backends.BACKENDS if trained_as(b, label))
        if kinds == ("cpu",):
            raise UserError("--device", f"--backend {backend} trains in host memory (--device cpu); for {device} use "
                            f"{others}")
        raise UserError("--device", f"{device} is a {device_kind(label).upper()}; --backend {backend} trains on "
                        f"{' or '.join(kinds)} devices: estimate it with {others}")
    return Target(backend, nproc, device, label, memory)


def _visible_gpu() -> tuple:
    import torch

    if not torch.cuda.is_available():
        raise UserError("--device", "no GPU is visible to tell which one the run trains on; name it: --device "
                        f"{{{','.join(k for k in hardware.DEVICE_MEMORY if k[0] != 'v')}}}")
    properties = torch.cuda.get_device_properties(0)
    return properties.name, properties.total_memory, torch.cuda.device_count()


# ---------------------------------------------------------------------------------- the estimating process


class Estimator:
    """Estimates in worker processes that import the frameworks (`serve`): one for the torch-based backends,
    one per device count for flax (JAX fixes its host-device count when it starts)."""

    def __init__(self):
        self._workers: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process, log in self._workers.values():
            process.stdin.close()
            process.wait(timeout=60)
            log.close()

    def estimate(self, config, target: Target, ranks: list) -> dict:
        """The backend's estimate for `config` on `target` (UserError when the plan does not lower there)."""
        environment = backends.load(target.backend).estimator_environment(target.nproc)
        key = tuple(sorted(environment.items()))  # backends asking for the same environment share a process
        if key not in self._workers:
            self._workers[key] = self._start(environment)
        process, log = self._workers[key]
        request = {"backend": target.backend, "config": config.to_dict(), "world": target.nproc, "ranks": ranks,
                   "device": target.device_type, "host_is_device": target.device == "cpu"}
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            log.seek(0)
            last = (log.read().strip().splitlines() or ["(no output)"])[-1]
            del self._workers[key]
            raise EstimateFailed(f"the estimating process stopped: {last}")
        reply = json.loads(line)
        if "user_error" in reply:
            raise UserError(*reply["user_error"])
        if "error" in reply:
            raise EstimateFailed(reply["error"])
        return reply["result"]

    @staticmethod
    def _start(environment: dict):
        env = {**os.environ, "USE_TORCH_XLA": "0", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
               "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1", **environment}
        log = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen([sys.executable, "-c", "from portable_fsdp.estimate import serve; serve()"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        return process, log


class EstimateFailed(Exception):
    pass


def serve() -> None:
    """The worker: one JSON request per line on stdin, one JSON reply per line on stdout. Whatever the libraries
    print goes elsewhere (stdout is the replies' channel only)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"result": _estimate_here(request)}
        except UserError as err:
            reply = {"user_error": [err.field, err.message]}
        except Exception as err:  # reported by the parent as the estimate's failure
            import traceback

            traceback.print_exc()
            reply = {"error": f"{type(err).__name__}: {err}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _estimate_here(request: dict) -> dict:
    import warnings

    from portable_fsdp.validate import check_backend

    backend, world = request["backend"], request["world"]
    config = from_dict(request["config"])
    plan = resolve_plan(config, world)
    module = backends.load(backend)
    info = module.describe_model(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the run itself prints them; here only refusals count
        check_backend(config, plan, backend, request["device"], world, info)
    return module.estimate_memory(request)


# -------------------------------------------------------------------------------------------- the verdict


@dataclasses.dataclass
class Report:
    config: object
    target: Target
    result: dict

    @property
    def peak(self) -> int:
        return max(rank["peak"] for rank in self.result["ranks"])

    @property
    def model(self) -> ModelInfo:
        """The model the estimate traced, as the backend described it."""
        return ModelInfo(**self.result["model"])

    @property
    def fits(self) -> bool:
        return self.peak <= self.target.usable

    @property
    def state(self) -> int:
        """Parameters and optimizer state a rank holds on its device throughout (0 when offloaded)."""
        rank = self.result["ranks"][0]
        return 0 if rank.get("cpu_offload") else rank["held"]["parameters"] + rank["held"]["optimizer"]


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A change to try: the command-line words that make it, its world size, the config fields it sets."""

    words: str
    nproc: int
    overrides: tuple = ()


def with_overrides(config, overrides) -> object:
    changed = from_dict(copy.deepcopy(config.to_dict()))
    for key, value in overrides:
        apply_override(changed, key, value)
    return changed


def alternative_groups(config, target: Target) -> list:
    """Changes that lower memory per rank, one group per kind, each in order of growing cost: the first of a
    group that fits is reported. Settings already on, or that the backend cannot lower, are left out."""
    t, p = config.train, config.plan
    groups = [[Alternative(f"--nproc {target.nproc * k}", target.nproc * k) for k in (2, 4, 8)]]
    if not p.activation_checkpointing:
        groups.append([Alternative("--config.plan.activation_checkpointing=true", target.nproc,
                                   (("plan.activation_checkpointing", "true"),))])
    if not p.cpu_offload and target.device != "cpu":  # host memory: no gain (a backend refusing it is skipped)
        groups.append([Alternative("--config.plan.cpu_offload=true", target.nproc, (("plan.cpu_offload", "true"),))])
    accumulation = [t.grad_accum_steps * 2**k for k in range(1, 8)]
    groups.append([Alternative(f"--config.train.grad_accum_steps={a}", target.nproc,
                               (("train.grad_accum_steps", str(a)),)) for a in accumulation])
    for axis in ("tp", "cp"):
        if p[f"{axis}_size"] == 1 and target.nproc > 1:
            groups.append([Alternative(f"--config.plan.{axis}_size={k}", target.nproc, ((f"plan.{axis}_size", str(k)),))
                           for k in (2, 4, 8) if target.nproc % k == 0])
    return [group for group in groups if group]


def one_sequence_per_micro_batch(config, nproc: int) -> tuple:
    """The override that makes each rank's micro-batch one sequence (grad_accum_steps = the batch per
    data-parallel rank), or none when it already is or the mesh does not resolve."""
    try:
        per_rank = config.train.batch_size // resolve_plan(config, nproc).mesh.data_parallel_size
    except UserError:
        return ()
    return (("train.grad_accum_steps", str(per_rank)),) if per_rank > config.train.grad_accum_steps else ()


def combined_alternatives(config, target: Target) -> list:
    """Tried when no single change fits: activation checkpointing with one sequence per micro-batch, then with
    CPU offload too (where the backend offloads), then with more ranks."""
    checkpointing = () if config.plan.activation_checkpointing else (("plan.activation_checkpointing", "true"),)
    settings = checkpointing + one_sequence_per_micro_batch(config, target.nproc)
    combos = [settings] if settings else []
    if target.device != "cpu" and not config.plan.cpu_offload:
        combos.append((*settings, ("plan.cpu_offload", "true")))
    tried = [Alternative(words(c), target.nproc, c) for c in combos]
    for k in (2, 4, 8):
        more = checkpointing + one_sequence_per_micro_batch(config, target.nproc * k)
        tried.append(Alternative(f"--nproc {target.nproc * k} {words(more)}".strip(), target.nproc * k, more))
    return tried


def words(overrides) -> str:
    return " ".join(f"--config.{key}={value}" for key, value in overrides)


def search(estimator: Estimator, report: Report) -> list:
    """[(Alternative, its Report)] of the changes that fit, at most one per group."""
    config, target = report.config, report.target
    found = []

    def fitting(alternative: Alternative):
        changed_target = target.with_nproc(alternative.nproc)
        offloads = any(key == "plan.cpu_offload" for key, _ in alternative.overrides)
        # a lower bound needs no trace: the state alone, spread over more ranks, already too much
        if not offloads and report.state * target.nproc / alternative.nproc * 0.99 > changed_target.usable:
            return None
        try:
            changed = with_overrides(config, alternative.overrides)
            resolve_plan(changed, alternative.nproc)
            result = estimator.estimate(changed, changed_target, [0])
        except UserError:
            return None  # the change does not lower there (batch does not split, heads do not divide, ...)
        candidate = Report(changed, changed_target, result)
        return candidate if candidate.fits else None

    for group in alternative_groups(config, target):
        for alternative in group:
            candidate = fitting(alternative)
            if candidate:
                found.append((alternative, candidate))
                break
    if not found:
        for alternative in combined_alternatives(config, target):
            candidate = fitting(alternative)
            if candidate:
                found.append((alternative, candidate))
                break
    return found


def verdict(report: Report, fitting: list) -> str:
    target = report.target
    if target.device == "cpu":
        memory = (f"{format_bytes(target.memory * target.nproc)} of host memory shared by {target.nproc} ranks, less "
                  f"{target.headroom:.0%} headroom")
    else:
        memory = f"{device_name(target)}: {format_bytes(target.memory)} less {target.headroom:.0%} headroom"
    where = f"{format_bytes(target.usable)} usable per rank ({memory})"
    if report.fits:
        return f"fits: peak {format_bytes(report.peak)} per rank, {where}"
    line = f"does not fit: peak {format_bytes(report.peak)} per rank exceeds {where}"
    if fitting:
        return line + "; settings that fit: " + "; ".join(
            f"{a.words} (peak {format_bytes(r.peak)})" for a, r in fitting)
    return line + "; none of the settings tried fits (more ranks, activation checkpointing, CPU offload, smaller " \
                  "micro-batches, tp/cp): use a device with more memory or a smaller model"


def device_name(target: Target) -> str:
    if target.device == "cpu":
        return "host memory"
    entry = hardware.datasheet_entry(target.label)
    return entry[0] if entry else target.label


# --------------------------------------------------------------------------------------------- the report


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def mesh_words(plan) -> str:
    mesh = plan.mesh
    axes = [f"{name} {size}" for name, size in mesh.axes() if size > 1 or name == "fsdp"]
    if mesh.ep_size > 1:
        axes.append(f"ep {mesh.ep_size} (of fsdp)")
    return " x ".join(axes)


def rank_groups(ranks: list) -> list:
    """[(rank numbers, their estimate)] with ranks of identical numbers together."""
    groups: list = []
    for rank in ranks:
        key = json.dumps({k: v for k, v in rank.items() if k not in ("rank", "seconds")}, sort_keys=True)
        for numbers, first, seen in groups:
            if seen == key:
                numbers.append(rank["rank"])
                break
        else:
            groups.append(([rank["rank"]], rank, key))
    return [(numbers, first) for numbers, first, _ in groups]


def rank_words(numbers: list, world: int, every_device: bool) -> str:
    if every_device:
        return f"every device (0-{world - 1})" if world > 1 else "device 0"
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"ranks {numbers[0]}-{numbers[-1]}"
    return "ranks " + ", ".join(map(str, numbers))


def table(rank: dict, unit: int, unit_name: str, usable: float, offloaded: bool) -> list:
    lines = [f"  {'':<22}{'held':>10}{'at peak':>10}   ({unit_name})"]
    held = rank.get("held", {})
    for key, name in ROWS:
        if key not in rank["at_peak"] and key not in held:
            continue
        if key in ("inputs", "outputs") and not rank["at_peak"].get(key):
            continue
        at_peak = "host" if offloaded and key in HELD else f"{rank['at_peak'].get(key, 0) / unit:.2f}"
        lines.append(f"  {name:<22}{(f'{held[key] / unit:.2f}' if key in held else '-'):>10}{at_peak:>10}")
    share = rank["peak"] / usable if usable else 0
    lines.append(f"  {'peak':<22}{'':>10}{rank['peak'] / unit:>10.2f}   ({share:.0%} of usable)")
    if offloaded:
        host = sum(held.get(k, 0) for k in HELD)
        lines.append(f"  host memory (offloaded parameters, gradients, AdamW state): {host / unit:.2f} {unit_name}")
    return lines


def step_line(report: Report, mfu: float) -> str:
    config, target = report.config, report.target
    plan = resolve_plan(config, target.nproc)
    tokens = config.train.batch_size * config.data.seq_len
    flops = flops_per_token(report.model, config.data.seq_len) * tokens
    dtype = plan.mixed_precision.param_dtype
    rate = config.train.peak_flops_per_device or (0 if target.device == "cpu"
                                                  else hardware.datasheet_flops(target.label, dtype))
    active = "" if report.model.n_active_params + report.model.n_embedding_params == report.model.n_params else \
        f", N = {report.model.n_active_params:,.0f} active parameters"
    text = f"step: {flops:.3g} FLOPs ({tokens:,} tokens; 6N + attention, portable_fsdp.metrics{active})"
    if not rate:
        return text + f"; no peak FLOP/s known for {target.label} in {dtype}: set train.peak_flops_per_device"
    seconds = flops / (target.nproc * rate * mfu)
    return text + f" -> {seconds:.3g} s per step at {mfu:.0%} MFU ({rate / 1e12:.0f} TFLOP/s {dtype} per device)"


def render(report: Report, mfu: float, recipe: str) -> str:
    config, target, result = report.config, report.target, report.result
    plan = resolve_plan(config, target.nproc)
    model = report.model
    first = result["ranks"][0]
    split = (f" ({first['tokens_per_rank']} tokens after splitting the sequence)" if plan.mesh.sequence_size > 1
             else "")
    if target.device == "cpu":
        where = f"{target.nproc} rank(s) sharing host memory ({format_bytes(target.memory)} each)"
    else:
        where = f"{target.nproc} x {device_name(target)} ({format_bytes(target.memory)} each)"
    lines = [f"estimate: {recipe}, --backend {target.backend}, {where}",
             f"model: {model.root_class}, {model.n_params:,} parameters; mesh {mesh_words(plan)}; "
             f"micro-batch {first['micro_batch_rows']} x {config.data.seq_len} tokens per rank{split}, "
             f"{config.train.grad_accum_steps} micro-batch(es) per step; compute {plan.mixed_precision.param_dtype}, float32 master "
             "weights",
             f"method: {result['method']}"]
    unit, unit_name = (2**30, "GiB") if report.peak >= 2**30 else (2**20, "MiB")
    every_device = result.get("same_on_every_device", False)
    for numbers, rank in rank_groups(result["ranks"]):
        lines.append("")
        lines.append(rank_words(numbers, target.nproc, every_device))
        lines += table(rank, unit, unit_name, target.usable, bool(rank.get("cpu_offload")))
    traced = [r["rank"] for r in result["ranks"]]
    if not every_device and len(traced) < target.nproc:
        lines.append(f"  (traced ranks {', '.join(map(str, traced))}: every FSDP shard is padded to one size, so "
                     "the ranks between hold the same; --ranks all traces each)")
    lines.append("")
    lines.append(step_line(report, mfu))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- entry points


def estimate_config(config, target: Target, ranks: list | None = None, estimator: Estimator | None = None) -> Report:
    """The estimate of `config` on `target`: ranks 0 and the last by default."""
    resolve_plan(config, target.nproc)  # a bad mesh or batch is one line before any process starts
    ranks = ranks if ranks is not None else sorted({0, target.nproc - 1})
    if estimator is not None:
        return Report(config, target, estimator.estimate(config, target, ranks))
    with Estimator() as own:
        return Report(config, target, own.estimate(config, target, ranks))


def check_fit(config, backend: str, world_size: int, device: str, local_ranks: int | None = None) -> None:
    """train.check_fit at start-up: a UserError naming settings that fit when the run's peak per rank exceeds its
    device's usable memory. `device`: the device type the run uses (cuda, cpu, TPU, ...)."""
    device = device.lower()
    if device == "cuda":
        name = "auto"  # the visible GPU
    elif device == "tpu":
        name = tpu_from_environment() or ""
        if not name:
            raise UserError("train.check_fit", "cannot tell which TPU this is: set TPU_ACCELERATOR_TYPE (e.g. v5p-8), "
                            "or check beforehand with python -m portable_fsdp.estimate --device v5p")
    elif device == "cpu":
        name = "cpu"
    else:
        raise UserError("train.check_fit", f"knows no memory size for {device} devices; set it to false, or check "
                        "with python -m portable_fsdp.estimate --device NAME")
    target = resolve_target(backend, name, local_ranks or world_size)
    target = dataclasses.replace(target, nproc=world_size)
    try:
        with Estimator() as estimator:
            report = estimate_config(config, target, [0], estimator)
            if report.fits:
                return
            line = verdict(report, search(estimator, report))
    except EstimateFailed as err:
        raise UserError("train.check_fit", f"the memory estimate failed ({err}); set it to false to start anyway")
    raise UserError("train.check_fit", line + "; set train.check_fit=false to start anyway")


def parse_args(argv):
    parser = Parser(prog="python -m portable_fsdp.estimate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help=f"recipe file[:variant] (default: the bundled {DEFAULT_RECIPE})")
    parser.add_argument("--backend", default="auto", choices=backends.CHOICES,
                        help="auto: xla for a TPU --device (or plan.xla), cuda for a GPU, else cpu")
    parser.add_argument("--device", default="auto",
                        help=f"{', '.join(hardware.DEVICE_MEMORY)} or cpu (host memory); auto: the visible GPU "
                             "on cuda, TPU_ACCELERATOR_TYPE on xla, host memory on cpu and flax")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (devices) the run trains on (default: the visible GPUs on cuda, 2 on cpu/flax, 1)")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time (0.4)")
    parser.add_argument("--headroom", type=float, default=HEADROOM,
                        help="share of each device's memory kept free for what is not modelled (0.1)")
    parser.add_argument("--ranks", default="", help="'all': trace every rank (default: the first and the last)")
    args, rest = parser.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        raise UserError("--nproc", f"must be at least 1 (got {args.nproc})")
    if not 0 < args.mfu <= 1:
        raise UserError("--mfu", f"must be in (0, 1] (got {args.mfu})")
    if not 0 <= args.headroom < 1:
        raise UserError("--headroom", f"must be in [0, 1) (got {args.headroom})")
    if args.ranks not in ("", "all"):
        raise UserError("--ranks", f"takes 'all' (got {args.ranks!r})")
    return args, config_overrides(rest)


def main(argv=None) -> int:
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        config = load_recipe(args.config)
        for key, value in overrides:
            apply_override(config, key, value)
        named = hardware.DEVICE_MEMORY.get(args.device.lower())
        backend = backends.for_device(args.backend, named[0] if named else None, config)
        backends.load(backend).prepare_config(config)
        target = dataclasses.replace(resolve_target(backend, args.device, args.nproc), headroom=args.headroom)
        recipe = args.config or DEFAULT_RECIPE
        with Estimator() as estimator:
            ranks = list(range(target.nproc)) if args.ranks == "all" else None
            report = estimate_config(config, target, ranks, estimator)
            print(render(report, args.mfu, recipe), flush=True)
            fitting = [] if report.fits else search(estimator, report)
        print(verdict(report, fitting), flush=True)
        return 0 if report.fits else 1
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    except EstimateFailed as err:
        print(f"error: the estimate failed: {err}", file=sys.stderr)
        return ESTIMATE_FAILED


if __name__ == "__main__":
    sys.exit(main())
