"""The contract between the neutral core and a lowering: what a backend provides, with the value types
they exchange. Imports no framework.

A backend is a module (`portable_fsdp.backends.<name>`) whose functions match `Backend` below, name for
name and parameter for parameter (tests/unit/test_backend_contract.py checks every registered backend).
The core drives it as a functional loop:

    state = backend.init(config, plan, backend_name)
    for step ...:
        state, metrics = backend.train_step(state, micro_batches)

**What `train_step` does to the state it is given.** The torch-based lowerings (cpu, cuda, xla) update the
model and optimizer in place and return a new `TrainState` that shares them; the flax lowering returns new
arrays. Either way the state passed in is *consumed*, as a donated buffer is in JAX: use only the returned
one afterwards (the old one's `step` is stale, and on torch its tensors already hold the new values).
The same holds for `load_checkpoint`. `eval_step`, `predict_step`, `count_label_tokens` and
`memory_report` leave the state as it was.

Collectives: every function that takes a state may be a collective; every rank calls it, in the same
order. `placement`, `model_info`, `device_kind` and `finalize` never communicate; `time_all_reduce` does (every rank
calls it, with the same size).

Before the loop, the command asks the backend what only it knows — which device it runs on, how many processes
by default, how its processes start, how its memory is estimated, how its SHARDED checkpoints convert — through
the functions under "Before any worker starts" below: they take no state and start no runtime, so the core never
branches on a backend's name and a new backend is a new folder.
"""
from __future__ import annotations

import dataclasses
import pathlib
from contextlib import AbstractContextManager
from typing import Protocol, Sequence, TypedDict

from portable_fsdp.training.parts import NONE as NO_PARTS, Parts

# The keys of `Backend.memory_report`, on every backend: each maps to one value per rank (per device under
# SPMD / JAX), in MiB.
MEMORY_KEYS = ("mem_mb", "peak_mem_mb", "reserved_mb", "peak_reserved_mb", "state_mb", "grad_mb", "base_mem_mb",
               "shm_mb")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process stands: its rank of `world_size`, and which slice of the global batch it reads."""

    rank: int
    world_size: int
    dp_rank: int  # which slice of the global batch this process reads
    dp_size: int  # how many slices the global batch is cut into (1 when one process drives every device)
    process_count: int = 0  # processes when one drives several devices (SPMD, JAX); 0: one per rank

    @property
    def processes(self) -> int:
        """How many processes there are (each writes and checksums its own part of a checkpoint)."""
        return self.process_count or self.world_size


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What start-up validation, the data check and MFU need to know of a model (read on the meta device)."""

    class_names: tuple
    no_split_modules: tuple
    n_params: int
    n_layers: int
    hidden_size: int
    vocab_size: int
    n_embedding_params: int = 0  # input embedding table(s): no matmul, left out of MFU's 6·N
    root_class: str = ""  # the model's own class (e.g. LlamaForCausalLM)
    inner_classes: dict = dataclasses.field(default_factory=dict)  # class -> the classes found inside it
    # The model's family and the settings of its own config.json that start-up checks read (the capability
    # table sees them as model.model_type, model.attention_dropout, ...): transformers' model_type ("llama",
    # "gpt2", ...); the attention-probability dropout and the config.json key that sets it; the shortest
    # sliding attention window of any layer (0: every layer attends to the whole sequence).
    model_type: str = ""
    attention_dropout: float = 0.0
    attention_dropout_key: str = ""
    sliding_window: int = 0
    # What the mesh checks divide (portable_fsdp/mesh_fit.py): attention and key/value heads, the experts of a
    # MoE layer (0: a dense model), and the model's own tensor-parallel plan (transformers' base_model_tp_plan:
    # module pattern -> colwise, rowwise, ...; empty when the family ships none).
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    num_experts: int = 0
    tp_plan: dict = dataclasses.field(default_factory=dict)
    # A MoE model's routed experts (MFU counts what a token runs through): the weights of every routed expert of
    # every layer (shared experts and the router are ordinary weights, not counted here), and how many of them
    # each token is sent to (top-k).
    n_routed_expert_params: int = 0
    experts_per_token: int = 0

    @property
    def n_active_params(self) -> float:
        """The weights one token's forward multiplies by: every parameter but the input embedding table (a lookup)
        and the routed experts a token is not sent to (top-k of the routed experts; all of them when the model
        does not say how many)."""
        idle = 0.0
        if self.n_routed_expert_params and self.num_experts and self.experts_per_token:
            idle = self.n_routed_expert_params * (1 - min(self.experts_per_token, self.num_experts) / self.num_experts)
        return self.n_params - self.n_embedding_params - idle


class StepMetrics(TypedDict):
    """What `train_step` returns besides the state: plain Python numbers, equal on every rank."""

    loss: float  # Σ token losses / Σ label tokens of the whole accumulated global batch
    tokens: int  # label tokens of the global batch
    grad_norm: float  # global L2 norm before clipping
    lr: float
    skipped: bool  # the update was not applied (train.nonfinite=skip and a non-finite loss or norm)


class TrainState(Protocol):
    """A backend's own state type; the core reads only `step` (optimizer updates applied so far)."""

    step: int


class Backend(Protocol):
    """The functions a backend module provides (signatures as the core calls them)."""

    # ---- before any worker starts: the command line, the launcher, the estimator (no state, no runtime)

    def device_type(self, backend: str) -> str:
        """The device type a run of `backend` (the name the user chose) lands on from this process, as the
        capability table names it ("cpu", "cuda"; torch_xla's "TPU"/"CPU"; JAX's platform). May import the
        framework (after `start_workers` has set its environment) but starts no runtime."""

    def default_nproc(self, backend: str) -> int:
        """--nproc when the user gives none: what this machine's devices suggest."""

    def prepare_config(self, config) -> None:
        """Move settings the backend reads under another name onto `config`'s plan, before the workers get it
        (xla: the xla_fsdp_settings that mean a plan field under SPMD FSDPv2)."""

    def start_workers(self, config, spec: dict, workdir: pathlib.Path, nproc: int, nodes, checks) -> dict | None:
        """Start this machine's workers and return the run's summary (rank 0's; None where another process
        returns it): `spec` is what `portable_fsdp.launch.worker.main` runs, `nodes` the machines of the run
        (`accelerate_launch.LaunchSettings`), `checks(config, backend_name, world_size, workdir, device=None,
        lowering_checks=None)` the launcher's start-up checks (launcher.preflight; `lowering_checks(plan)`: the
        lowering's own, run after the shared ones), to call once the world size is known and before any worker
        starts. A failed run prints its `error:` line and raises SystemExit with its exit status."""

    def check_machines(self, nodes, path: str) -> None:
        """Refuse, naming the key of the Accelerate file at `path`, a run on several machines (`nodes.multi_node`)
        that this backend cannot start."""

    def owns_workdir(self, nodes) -> bool | None:
        """Whether this process holds the run's workdir lock (machine 0's launcher, a TPU slice's worker 0, rank
        0 under torchrun); None while it cannot tell yet (before `start_workers` set its environment up)."""

    def sharded_format(self) -> str:
        """The format of this backend's SHARDED_STATE_DICT checkpoints: backends with the same format resume
        each other's (`portable_fsdp.checkpoint.layout.check_compatible`)."""

    def convert_sharded(self, source: pathlib.Path, target: pathlib.Path) -> None:
        """Write a SHARDED_STATE_DICT checkpoint this backend saved as a FULL one (`python -m
        portable_fsdp.convert`), offline in one process, or raise UserError saying what to do instead."""

    def estimate_devices(self, backend: str) -> tuple:
        """The device kinds `backend` trains on, in the capability table's words ("cpu", "cuda", "gpu", "tpu"),
        the one `python -m portable_fsdp.estimate --device auto` assumes first."""

    def estimator_environment(self, nproc: int) -> dict:
        """The environment variables of the process this backend's `estimate_memory` runs in, for a world of `nproc`
        (backends asking for the same share one process)."""

    def estimate_memory(self, request: dict) -> dict:
        """The memory estimate, in the estimating process: `request` holds the config (a dict), the world size,
        the ranks to trace and the device kind; the reply holds per-rank peaks (`portable_fsdp.estimate`), the
        model's `ModelInfo` fields and `method`, one line saying how the figures were obtained."""

    # ---- the run

    def describe_model(self, config, parts: Parts = NO_PARTS) -> ModelInfo:
        """The model's shape and classes, without materialising weights: start-up checks run on it. `parts.model`,
        when given, is the model described (else the config's)."""

    def init(self, config, plan, backend: str, parts: Parts = NO_PARTS) -> TrainState:
        """Start the runtime (process group, devices), build the model and the optimizer as `plan` says.
        `backend` is the name the user chose (cpu and cuda share one lowering). `parts`: the model, loss,
        optimizer and schedule the user brings in place of the config's (portable_fsdp/training/parts.py); a
        part this backend cannot run is a UserError naming it."""

    def train_step(self, state: TrainState, micro_batches: Sequence) -> tuple[TrainState, StepMetrics]:
        """One optimizer step over this rank's micro-batches (`data.batch.Batch`); consumes `state`."""

    def count_label_tokens(self, state: TrainState, batch) -> int:
        """num_items_in_batch: label tokens of the global batch, counted before any sequence sharding."""

    def eval_step(self, state: TrainState, batch, num_items_in_batch: int) -> dict:
        """{"loss_sum": Σ token losses of the global batch}; the eval layer divides once by the tokens. Under a
        custom loss, also "count": its Σ count over the global batch, which the eval layer divides by instead."""

    def predict_step(self, state: TrainState, batch, return_logits: bool = False, preprocess_logits=None) -> dict:
        """Full-length predictions of the global batch in token order, as numpy, on every rank:
        {"predictions", "labels" (when the batch has them), "logits" (when asked)}. `preprocess_logits(logits,
        labels) -> array`, Trainer's preprocess_logits_for_metrics, takes the place of the logits: called on this
        rank's rows (full length: gathered along the sequence first), with the backend's own arrays (torch
        tensors, jax arrays), before the rows of the data-parallel ranks are gathered; it keeps the rows as its
        first dimension, and the same shape on every rank."""

    def save_checkpoint(self, state: TrainState, directory: pathlib.Path) -> dict:
        """Write this rank's part of a checkpoint into `directory` (which exists), in the layout of
        `portable_fsdp.checkpoint.layout`: the product's backends call `portable_fsdp.checkpoint.files.write` with their
        `checkpoint_files.Writer` (which files, on which process, in which order is decided there). Returns the
        files this rank wrote, {path: checksum entry when hashed while writing (checkpointing.HashingWriter), else
        None}: the checkpoint session checksums the others on this rank, right after. With train.async_save, a
        backend that writes in the background returns a concurrent.futures.Future of that dict instead, once the
        state is copied (portable_fsdp/checkpoint/async_save.py finishes the save)."""

    def export_weights(self, state: TrainState, directory: pathlib.Path) -> dict:
        """Write the model as FULL checkpoints hold it, without the optimizer state, into `directory` (which
        exists): the weights in train.save_dtype (safetensors shards + index, streamed as the FULL save does),
        config.json and generation_config.json; every rank calls it (train.export_full_at_end;
        `checkpoint_files.write_export`). Returns the files this rank wrote, as `save_checkpoint` does (never a
        future)."""

    def load_checkpoint(self, state: TrainState, directory: pathlib.Path, manifest: dict) -> TrainState:
        """Restore weights, optimizer state, step and RNG from a verified checkpoint; consumes `state`."""

    def memory_report(self, state: TrainState) -> dict:
        """{key: [MiB per rank]} for every key of MEMORY_KEYS."""

    def placement(self, state: TrainState) -> Placement:
        """This process's rank and data slice."""

    def barrier(self, state: TrainState, timeout_s: float | None = None) -> None:
        """Wait until every process arrives: within `timeout_s` when given (saves and verifications, which
        allow for their bytes: checkpointing.io_timeout_s), else train.collective_timeout_s where the backend
        bounds its waits."""

    def any_rank(self, state: TrainState, flag: bool) -> bool:
        """True on every process when `flag` is true on any."""

    def device_kind(self, state: TrainState) -> str:
        """The device this process computes on, as its framework names it ("NVIDIA H100 80GB HBM3",
        "TPU v5 lite"; "cpu" on a CPU): MFU's datasheet peak is looked up by it (`portable_fsdp.machine.hardware`)."""

    def time_matmul(self, state: TrainState, size: int, dtype: str) -> float:
        """Seconds one (size × size) @ (size × size) product in `dtype` (a plan dtype name) takes, operands
        already on the device, until the result is ready, every device this process drives computing its own
        copy at once: the primitive behind the measured peak, which `portable_fsdp.machine.hardware` warms up and
        repeats."""

    def time_all_reduce(self, state: TrainState, size: int) -> float:
        """Seconds one all-reduce (a sum) of `size` bytes of float32 over every device of the run takes, every
        device's operand already in place, until every result is ready: the primitive behind the measured
        collective bandwidth, which `portable_fsdp.machine.hardware` warms up, repeats and turns into bus bandwidth."""

    def start_trace(self, state: TrainState, directory: pathlib.Path) -> None:
        """Start this framework's profiler, recording what this process runs until `stop_trace`; the trace is
        written under `directory` in a form TensorBoard's profiler plugin and Perfetto open."""

    def step_annotation(self, state: TrainState, step: int) -> AbstractContextManager:
        """A context manager around one train step that names it (`step` counted from 1) in the trace."""

    def stop_trace(self, state: TrainState) -> None:
        """Stop the profiler `start_trace` started and write its trace."""

    def watch_memory(self, state: TrainState, path: pathlib.Path) -> bool:
        """Keep the device allocator's history so that a step running out of memory writes it to `path` before
        the error; False where the device keeps none (only CUDA's caching allocator does)."""

    def model_info(self, state: TrainState) -> ModelInfo:
        """The `describe_model` of the model this state trains."""

    def finalize(self, state: TrainState | None = None) -> None:
        """Tear the runtime down (process group, device queues); `state` may be None after a failed init."""


def contract_functions() -> tuple:
    """The names a backend module must define."""
    return tuple(name for name in Backend.__dict__ if not name.startswith("_") and callable(Backend.__dict__[name]))
