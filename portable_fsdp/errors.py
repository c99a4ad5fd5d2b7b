"""The ways a run ends on purpose: UserError (a fixable mistake: one `error:` line, exit 2),
TrainingDiverged (exit 3) and Interrupted (exit 130); and Notice, what the user should know that stops
nothing (one `warning:` line)."""
import math
import warnings


class UserError(Exception):
    """A bad input. `field` names what to change; the message says how."""

    exit_code = 2

    def __init__(self, field: str, message: str):
        # One line whatever the input held: a key or value read from a file may contain line breaks.
        self.field = _one_line(field)
        self.message = _one_line(message)
        super().__init__(f"{self.field}: {self.message}")

    def line(self) -> str:
        return f"error: {self.field}: {self.message}"


def _one_line(text: str) -> str:
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run (after saving a checkpoint when train.save_on_interrupt)."""

    exit_code = 130

    def __init__(self, signal_name: str, saved):
        self.saved = saved
        where = f"; checkpoint saved at {saved}, resume with --config.train.resume=true" if saved else ""
        super().__init__(f"interrupted by {signal_name}{where}")

    def line(self) -> str:
        return f"error: {self}"


class TrainingDiverged(Exception):
    """The loss or the gradients stopped being finite (train.nonfinite=stop)."""

    exit_code = 3

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step = step
        super().__init__(f"step {step}: the loss is {loss} and the gradient norm {grad_norm}; training stopped "
                         "before applying it, earlier checkpoints are kept. Lower train.lr, or set "
                         "train.nonfinite=skip to skip such steps")

    def line(self) -> str:
        return f"error: {self}"


def require_finite(step: int, loss: float, grad_norm: float, nonfinite: str) -> bool:
    """Whether step `step` may be applied; raises TrainingDiverged under train.nonfinite=stop. Every
    backend passes the globally reduced loss and norm, so every rank decides the same."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if not finite and nonfinite == "stop":
        raise TrainingDiverged(step, loss, grad_norm)
    return finite


class Notice(UserWarning):
    """A setting that runs, but not as the user may expect (ignored, replaced, costly): the command prints it as
    one `warning: ...` line, without Python's source line."""


def notify(message: str) -> None:
    """Warn the user in one line (a Notice), attributed to the caller's caller."""
    warnings.warn(message, Notice, stacklevel=3)


_python_format = warnings.formatwarning


def _format(message, category, filename, lineno, line=None) -> str:
    if issubclass(category, Notice):
        return f"warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


def print_notices_as_lines() -> None:
    """Make this process print every Notice as one `warning:` line (the command's processes call it; a
    notebook keeps Python's format)."""
    warnings.formatwarning = _format
