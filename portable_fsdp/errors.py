"""The one exception type for mistakes a user can fix: it becomes a one-line `error:` and exit 2."""


class UserError(Exception):
    """A bad input. `field` names what to change; the message says how."""

    exit_code = 2

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def line(self) -> str:
        return f"error: {self.field}: {self.message}"


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
