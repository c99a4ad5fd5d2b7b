"""train.profile_steps: the window's validation and when the backend's trace starts and stops."""
import contextlib

import pytest

from portable_fsdp.training.profiling import StepProfiler, profile_window
from tests.unit._helpers import user_error


@pytest.mark.parametrize("given, phrase", [(["3", "2"], "1 <= FIRST <= LAST"), (["0", "2"], "within 1..10"),
                                           (["-1", "2"], "within 1..10"), (["2", "11"], "within 1..10"),
                                           (["2"], "two step numbers"), (["a", "b"], "two step numbers")])
def test_a_bad_window_is_an_error_naming_the_field(given, phrase):
    with user_error("train.profile_steps", phrase):
        profile_window(given, 10)


def test_a_window_from_the_command_line_or_a_recipe():
    assert profile_window(["2", "5"], 10) == profile_window([2, 5], 10) == (2, 5)
    assert profile_window([], 10) is None


class RecordingBackend:
    def __init__(self):
        self.calls = []

    def start_trace(self, state, directory):
        self.calls.append("start")

    def step_annotation(self, state, step):
        self.calls.append(step)
        return contextlib.nullcontext()

    def stop_trace(self, state):
        self.calls.append("stop")


@pytest.mark.parametrize("steps, expected", [
    (range(1, 7), ["start", 2, 3, 4, "stop"]),
    (range(3, 7), ["start", 3, 4, "stop"]),  # resumed inside the window
    (range(1, 4), ["start", 2, 3, "stop"]),  # stopped inside it: the end of the loop writes the trace
])
def test_the_trace_covers_the_window_steps_this_run_reaches(tmp_path, steps, expected):
    backend = RecordingBackend()
    profiler = StepProfiler(backend, (2, 4), tmp_path / "profile")
    for number in steps:
        with profiler.step(None, number):
            pass
    profiler.stop(None)
    assert backend.calls == expected
    assert (tmp_path / "profile").is_dir()


def torch_state(device_type):
    """What watch_memory reads of a torch backend's state: the device it runs on (injected: no GPU here)."""
    from types import SimpleNamespace

    return SimpleNamespace(ctx=SimpleNamespace(runtime=SimpleNamespace(device=SimpleNamespace(type=device_type))))


def test_a_cuda_out_of_memory_writes_the_watched_history_before_the_error(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from portable_fsdp.backends.torch import resources

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(resources, "_snapshot_path", None)
    assert resources.watch_memory(torch_state("cpu"), tmp_path / "s.pickle") is False and calls == []
    assert resources.watch_memory(torch_state("cuda"), tmp_path / "s.pickle") is True
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with resources.snapshot_on_out_of_memory():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert calls == [("record", {"max_entries": 100_000}), ("dump", str(tmp_path / "s.pickle"))]
    assert "pytorch.org/memory_viz" in capsys.readouterr().err
