"""`portable-fsdp COMMAND [ARGS]`: the console script, one name for every `python -m portable_fsdp.COMMAND`."""
from __future__ import annotations

import importlib
import sys

# command -> the module whose main(argv) it runs, the same one `python -m` runs
COMMANDS = {
    "run": "portable_fsdp.run",
    "estimate": "portable_fsdp.estimate.__main__",
    "selftest": "portable_fsdp.selftest.__main__",
    "crosscheck": "portable_fsdp.crosscheck",
    "plot": "portable_fsdp.plot",
    "convert": "portable_fsdp.convert",
}

USAGE = (f"usage: portable-fsdp {{{','.join(COMMANDS)}}} [ARGS]\n\n"
         "Each command is `python -m portable_fsdp.COMMAND`; `portable-fsdp COMMAND --help` shows its arguments.")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: command line: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
