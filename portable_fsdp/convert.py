"""`python -m portable_fsdp.convert SHARDED_CHECKPOINT OUT_DIR`: a SHARDED_STATE_DICT checkpoint (torch
distributed checkpoint shards) becomes a FULL one that `from_pretrained` loads — offline, one process. The orbax
files of --backend flax are refused: a flax run exports its FULL weights itself (train.export_full_at_end)."""
from __future__ import annotations

import argparse
import pathlib
import sys

from portable_fsdp import checkpointing
from portable_fsdp.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_fsdp.convert", description=__doc__)
    parser.add_argument("source", help="a checkpoint directory (checkpoints/step_XXXXXXXX) with sharded/")
    parser.add_argument("target", help="a new directory for the FULL checkpoint")
    args = parser.parse_args(argv)
    try:
        _refuse_orbax(pathlib.Path(args.source))
        from portable_fsdp.backends.torch.convert import sharded_to_full

        sharded_to_full(args.source, args.target)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    print(f"wrote {args.target}")
    return 0


def _refuse_orbax(source: pathlib.Path) -> None:
    """--backend flax writes its SHARDED checkpoints with orbax, which this converter does not read. A manifest that
    cannot be read is left to the converter's own checks, which name what is wrong with it."""
    try:
        backend = checkpointing.read_manifest(source).get("backend")
    except (OSError, ValueError, AttributeError):
        return
    if backend == "flax":
        raise UserError("source", (
            f"{source} is a SHARDED_STATE_DICT checkpoint of --backend flax (orbax files), which this converter does "
            "not read; run with --config.train.export_full_at_end=true for its FULL weights, or resume it on "
            "--backend flax with --config.plan.state_dict_type=FULL_STATE_DICT, whose saves are FULL"))


if __name__ == "__main__":
    sys.exit(main())
