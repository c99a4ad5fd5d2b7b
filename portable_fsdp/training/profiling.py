"""train.profile_steps: a trace of train steps FIRST..LAST through the backend's own profiler (torch.profiler,
torch_xla's, jax's), written under <workdir>/profile for TensorBoard's profiler plugin or Perfetto."""
from __future__ import annotations

import contextlib
import pathlib

from portable_fsdp.errors import UserError


def profile_window(profile_steps, steps: int) -> tuple[int, int] | None:
    """The validated (first, last) steps, counted from 1 as the log counts them; None when nothing is profiled.
    The command line gives the list as text (`3,5`), a recipe as numbers."""
    if not profile_steps:
        return None
    try:
        first, last = (int(step) for step in profile_steps)
    except (TypeError, ValueError):
        raise UserError("train.profile_steps", f"expects two step numbers FIRST,LAST (got {list(profile_steps)}); "
                        "e.g. --config.train.profile_steps=3,5") from None
    if not 1 <= first <= last <= steps:
        raise UserError("train.profile_steps", f"{first},{last} is not a range of steps within 1..{steps} "
                        "(train.steps): give FIRST,LAST with 1 <= FIRST <= LAST <= train.steps, e.g. 3,5")
    return first, last


class StepProfiler:
    """Starts the backend's trace at the first step of the window this run reaches (a resumed run may start
    inside it), names each step of the window in it, and writes it after the last one."""

    def __init__(self, backend, window: tuple[int, int] | None, directory: pathlib.Path):
        self._backend, self._window, self._directory = backend, window, directory
        self._tracing = self._finished = False

    @contextlib.contextmanager
    def step(self, state, number: int):
        if self._window is None or self._finished or not self._window[0] <= number <= self._window[1]:
            yield
            return
        if not self._tracing:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._backend.start_trace(state, self._directory)
            self._tracing = True
        with self._backend.step_annotation(state, number):
            yield
        if number == self._window[1]:
            self.stop(state)

    def stop(self, state) -> None:
        """Write the trace now if it is still running (a run that stops inside the window)."""
        if self._tracing:
            self._backend.stop_trace(state)
            self._tracing, self._finished = False, True
