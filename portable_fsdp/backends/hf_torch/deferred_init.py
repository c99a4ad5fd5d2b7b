"""A seeded random init without the whole model in memory: the model is built on the meta device while every
operation that writes a parameter is recorded, then the recording is replayed on the CPU, one parameter at a
time, through the same global generator — each full parameter exists only while its values are drawn, and the
caller keeps only its own slice of it (portable_fsdp/backends/torch/model.materialize_shards).

transformers builds a model in two passes that both draw from the global generator: each module's own
constructor init (nn.Linear's kaiming_uniform_, nn.Embedding's normal_), then `_init_weights` over every
module, then the tying of weights. A draw whose values are later overwritten is replayed too (into a scratch
tensor, then dropped) so that every later draw sees the generator state of the single-process init: the replayed
values equal `torch.manual_seed(seed); AutoModelForCausalLM.from_config(cfg)` bit for bit (tested in
tests/dist/test_meta_init.py)."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# In-place operations that draw from the generator (they must be replayed even when their values are dropped).
RANDOM_INPLACE = {"normal_", "uniform_", "bernoulli_", "exponential_", "random_", "cauchy_", "log_normal_",
                  "geometric_"}
# Out-of-place operations that draw; replayed for the generator's sake when their inputs are plain numbers.
RANDOM_FACTORIES = {"randn", "rand", "randint", "randperm", "normal", "rand_like", "randn_like"}
# In-place operations whose result does not depend on the tensor's previous values.
OVERWRITING = RANDOM_INPLACE - {"bernoulli_"} | {"fill_", "zero_"}
NO_WRITE = {"detach", "alias", "view", "_unsafe_view", "as_strided", "t", "transpose", "slice", "select",
            "unsqueeze", "squeeze", "expand", "permute", "lift_fresh", "reshape"}


class Unsupported(Exception):
    """The model's init does something the replay cannot reproduce exactly (the caller builds it whole)."""


@dataclasses.dataclass
class Step:
    key: int | None  # the storage written (None: an out-of-place random operation)
    func: object
    args: tuple  # the first argument of an in-place operation is replaced by its view geometry
    kwargs: dict
    factory: bool = False
    reads_tensors: bool = False  # an in-place operation taking values from another tensor


def _base(op) -> str:
    return op._schema.name.split("::")[-1]


def _geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.untyped_storage().nbytes() // t.element_size(),
            t.dtype)


class _Recorder(TorchDispatchMode):
    """Records factory and in-place operations on meta tensors, keyed by their storage."""

    def __init__(self):
        super().__init__()
        self.steps: list = []
        self.keep: list = []  # storages stay alive while recording, so no key is ever reused
        self.geometry: dict = {}

    def key(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        self.keep.append(storage)
        return storage._cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _base(func)
        if name in NO_WRITE:
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if name in RANDOM_INPLACE and (len(inputs) > 1 or not inputs[0].is_meta):
            raise Unsupported(f"{name} with tensor arguments or off the meta device")
        if name.endswith("_") and inputs and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self._inplace(func, args, kwargs)
        elif name in RANDOM_FACTORIES:
            if inputs:
                raise Unsupported(f"{name} of a tensor")
            self.steps.append(Step(None, func, args, _on_cpu(kwargs)))
        elif not inputs and isinstance(out, torch.Tensor) and out.is_meta:
            key = self.key(out)
            self.geometry[key] = _geometry(out)
            self.steps.append(Step(key, func, args, _on_cpu(kwargs), factory=True))
        return out

    def _inplace(self, func, args, kwargs) -> None:
        target = args[0]
        others = [a for a in tree_flatten((args[1:], kwargs))[0] if isinstance(a, torch.Tensor)]
        key = self.key(target)
        self.geometry.setdefault(key, _geometry(target))
        # A value from another tensor: replayable only if nothing reads it back (checked by `plan`).
        self.steps.append(Step(key, func, (_geometry(target), *args[1:]), kwargs, reads_tensors=bool(others)))


def _on_cpu(kwargs: dict) -> dict:
    return {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs


@dataclasses.dataclass
class Recording:
    steps: list
    geometry: dict  # storage key -> (shape, stride, offset, storage numel, dtype)
    names: dict  # storage key -> the parameter names held there (tied weights: several)


@contextlib.contextmanager
def _init_runs_on_meta():
    """transformers skips `_init_weights` when the model is built on the meta device; run it anyway, so the
    recording holds the same operations as the CPU init."""
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.get_torch_context_manager_or_global_device
    modeling_utils.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        modeling_utils.get_torch_context_manager_or_global_device = original


def build_on_meta(build) -> tuple:
    """(the model `build()` returns, built on the meta device; the recording of its parameters' init)."""
    recorder = _Recorder()
    with _init_runs_on_meta(), torch.device("meta"), recorder:
        model = build()
    return model, _recording(recorder, model)


def record_init(model, init) -> Recording:
    """The recording of `init()` (e.g. a module's own init_weights) writing every parameter of `model`, a module
    already on the meta device: replayed, it gives `torch.manual_seed(seed); init()` on the CPU bit for bit."""
    recorder = _Recorder()
    with recorder:
        init()
    return _recording(recorder, model)


def _recording(recorder: _Recorder, model) -> Recording:
    names: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(recorder.key(param), []).append(name)
    for key in names:
        if key not in recorder.geometry:
            raise Unsupported(f"{names[key][0]} is written by no recorded operation")
        shape, stride, offset, numel, _ = recorder.geometry[key]
        if offset != 0 or numel != _numel(shape):
            raise Unsupported(f"{names[key][0]} is a view of a larger tensor")
    recording = Recording(recorder.steps, recorder.geometry, names)
    _check(recording)
    return recording


@dataclasses.dataclass
class OnMeta:
    """A model built on the meta device, how to fill it and its computed buffers. `fill(deliver)` calls
    `deliver(names, full)` once per parameter, in turn, with its full fp32 value (the tied names together)."""

    model: torch.nn.Module
    fill: object
    buffers: dict


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _covers(geometry: tuple) -> bool:
    shape, stride, offset, numel, _ = geometry
    return offset == 0 and _numel(shape) == numel and torch.empty_strided(shape, stride, device="meta").is_contiguous()


def _live_from(recording: Recording) -> dict:
    """Storage key of each parameter -> index of the step from which its final values are made: its last
    factory or whole-tensor overwrite (the earlier steps only matter for the generator)."""
    start = {}
    for index, step in enumerate(recording.steps):
        if step.key in recording.names and (step.factory or (
                _base(step.func) in OVERWRITING and _covers(step.args[0]) and not step.reads_tensors)):
            start[step.key] = index
    return start


def _check(recording: Recording) -> None:
    start = _live_from(recording)
    for key, names in recording.names.items():
        if key not in start:
            raise Unsupported(f"{names[0]} is never written whole")
    for index, step in enumerate(recording.steps):
        if step.key in recording.names and not step.factory and index > start[step.key] and step.reads_tensors:
            raise Unsupported(f"{recording.names[step.key][0]} is initialised from another tensor")


def replay(recording: Recording, seed: int, deliver) -> None:
    """Replay the init from `torch.manual_seed(seed)`; `deliver(names, full)` receives each parameter's final
    values once its last operation has run (then they are dropped)."""
    start = _live_from(recording)
    last = {step.key: index for index, step in enumerate(recording.steps) if step.key in recording.names}
    live: dict = {}
    torch.manual_seed(seed)
    with torch.no_grad():
        for index, step in enumerate(recording.steps):
            name = _base(step.func)
            if step.key is None:  # an out-of-place draw: for the generator only
                step.func(*step.args, **step.kwargs)
            elif step.key in recording.names and index >= start[step.key]:
                if step.factory:
                    live[step.key] = step.func(*step.args, **step.kwargs)
                else:
                    if step.key not in live:
                        live[step.key] = _empty(recording.geometry[step.key])
                    shape, stride, offset, _, _ = step.args[0]
                    step.func(live[step.key].as_strided(shape, stride, offset), *step.args[1:], **step.kwargs)
                if index == last[step.key]:
                    deliver(recording.names[step.key], live.pop(step.key))
            elif name in RANDOM_INPLACE:  # values overwritten later (or of no parameter): draw and drop
                shape, stride, offset, _, _ = step.args[0]
                step.func(_empty(step.args[0]).as_strided(shape, stride, offset), *step.args[1:], **step.kwargs)


def _empty(geometry: tuple) -> torch.Tensor:
    """An uninitialised tensor over a whole storage of `geometry`, in its first view's shape and strides."""
    shape, stride, offset, numel, dtype = geometry
    return torch.empty(numel, dtype=dtype).as_strided(shape, stride, offset)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter moved to the meta device as it is registered; buffers stay real (accelerate's
    init_empty_weights(include_buffers=False))."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.detach().to("meta"), param.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def computed_buffers(build) -> dict:
    """The buffers of the model `build()` returns, computed on the CPU (rotary inv_freq: in no checkpoint, made
    by the model's code), its parameters never allocated."""
    with _init_runs_on_meta(), _parameters_on_meta():
        model = build()
    return dict(model.named_buffers())
