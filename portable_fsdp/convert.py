"""`python -m portable_fsdp.convert SHARDED_CHECKPOINT OUT_DIR`: a SHARDED_STATE_DICT checkpoint becomes a FULL one
that `from_pretrained` loads — offline, one process, by the backend that wrote it (`Backend.convert_sharded`:
torch's distributed checkpoint files convert; a backend whose files do not says what to run instead)."""
from __future__ import annotations

import argparse
import pathlib
import sys

from portable_fsdp import backends

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_fsdp.convert", description=__doc__)
    parser.add_argument("source", help="a checkpoint directory (checkpoints/step_XXXXXXXX) with sharded/")
    parser.add_argument("target", help="a new directory for the FULL checkpoint")
    args = parser.parse_args(argv)
    try:
        backends.load(_written_by(pathlib.Path(args.source))).convert_sharded(pathlib.Path(args.source),
                                                                               pathlib.Path(args.target))
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    print(f"wrote {args.target}")
    return 0


def _written_by(source: pathlib.Path) -> str:
    """The backend the manifest names. A manifest that cannot be read (or names no backend) goes to the default
    backend's converter, whose own checks name what is wrong with the checkpoint."""
    try:
        backend = checkpointing.read_manifest(source).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    return backend if backend in backends.BACKENDS else backends.DEFAULT


if __name__ == "__main__":
    sys.exit(main())
