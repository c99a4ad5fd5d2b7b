"""`python -m portable_fsdp.convert SHARDED_CHECKPOINT OUT_DIR`: a SHARDED_STATE_DICT checkpoint (torch
distributed checkpoint shards) becomes a FULL one that `from_pretrained` loads — offline, one process."""
from __future__ import annotations

import argparse
import sys

from portable_fsdp.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_fsdp.convert", description=__doc__)
    parser.add_argument("source", help="a checkpoint directory (checkpoints/step_XXXXXXXX) with sharded/")
    parser.add_argument("target", help="a new directory for the FULL checkpoint")
    args = parser.parse_args(argv)
    try:
        from portable_fsdp.backends.torch.convert import sharded_to_full

        sharded_to_full(args.source, args.target)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
