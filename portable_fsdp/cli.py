"""What the commands (`run`, `estimate`, `crosscheck`, `selftest`, `plot`) share: a parser whose errors are one
`error:` line, `--config.a.b=value` overrides, and the default workdir."""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib

from portable_fsdp.errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line and exit 2, not a usage dump
        raise UserError("command line", message)


def config_overrides(items) -> list:
    """`--config.a.b=value` arguments -> [("a.b", "value"), ...]; any other argument is an error."""
    overrides = []
    for item in items:
        if not item.startswith("--config."):
            raise UserError("command line", f"unrecognised argument {item!r}; fields are set as --config.a.b=value")
        key, sep, value = item[len("--config."):].partition("=")
        if not sep:
            raise UserError(f"config.{key}", "needs a value: write --config.a.b=value")
        overrides.append((key, value))
    return overrides


def default_workdir(name: str) -> pathlib.Path:
    """runs/<name>-<time>. Under torchrun every rank must name the same directory: its run id, not each
    rank's clock."""
    stamp = os.environ.get("TORCHELASTIC_RUN_ID") or f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    return pathlib.Path(f"runs/{name}-{stamp}")
