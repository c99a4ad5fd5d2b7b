"""Shared assertions for the unit tests."""
import contextlib

import pytest

from portable_fsdp.errors import UserError


@contextlib.contextmanager
def user_error(field, phrase):
    """Expect a UserError naming exactly `field` whose message contains `phrase`; yields pytest's ExceptionInfo."""
    with pytest.raises(UserError) as info:
        yield info
    err = info.value
    assert err.field == field, f"field {err.field!r} != {field!r} (message: {err.message})"
    assert phrase in err.message, f"{phrase!r} not in message {err.message!r}"
