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
