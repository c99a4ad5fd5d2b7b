"""`python -m portable_fsdp.estimate --config RECIPE[:variant] [--nproc N] [--backend cpu|cuda|xla|flax]
[--device h100|h200|a100|a100-40|v4|v5e|v5p|v6e|cpu] [--mfu 0.4] [--config.a.b=v ...]`

Will a run fit, before it starts? Per rank: parameters, gradients and optimizer state, the activations and
the gathered (all-gathered) weights at the step's peak, against the device's memory; the FLOPs of a step and
its time at a stated MFU. Needs no accelerator: the lowering's own start-up runs on fake tensors
(cpu, cuda: torch FSDP2 traced over a fake process group; flax: the jitted step compiled for abstract inputs;
xla: an analytical estimate — see docs/estimate.md).

Exit status: 0 it fits; 1 it does not, and the last line names settings that would (each tried here); 2 a bad
input (one `error:` line); 3 the estimate itself failed.

The framework work runs in a separate process (`serve`), so this module imports no framework and the fake
process group never meets a real one.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from portable_fsdp import backends

from portable_fsdp.machine import hardware
from portable_fsdp.cli import Parser, config_overrides
from portable_fsdp.config.schema import DEFAULT_RECIPE, apply_override, load_recipe
from portable_fsdp.configs.hardware import launch_flags
from portable_fsdp.errors import UserError, print_notices_as_lines
from portable_fsdp.estimate.fit import estimate_config
from portable_fsdp.estimate.process import EstimateFailed, Estimator
from portable_fsdp.estimate.report import render, verdict
from portable_fsdp.estimate.search import search
from portable_fsdp.estimate.target import HEADROOM, resolve_target

ESTIMATE_FAILED = 3


def parse_args(argv):
    parser = Parser(prog="python -m portable_fsdp.estimate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help=f"recipe file[:variant] (default: the bundled {DEFAULT_RECIPE})")
    parser.add_argument("--backend", default="auto", choices=backends.CHOICES,
                        help="auto: the recipe variant's, else xla for a TPU --device (or plan.xla), cuda for a GPU, "
                             "else cpu")
    parser.add_argument("--device", default="auto",
                        help=f"{', '.join(hardware.DEVICE_MEMORY)} or cpu (host memory); auto: the recipe variant's, "
                             "else the visible GPU on cuda, TPU_ACCELERATOR_TYPE on xla, host memory on cpu and flax")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (devices) the run trains on (default: the recipe variant's, else the visible GPUs "
                             "on cuda, 2 on cpu/flax, 1)")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time (0.4)")
    parser.add_argument("--headroom", type=float, default=HEADROOM,
                        help="share of each device's memory kept free for what is not modelled (0.1)")
    parser.add_argument("--ranks", default="", help="'all': trace every rank (default: the first and the last)")
    args, rest = parser.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        raise UserError("--nproc", f"must be at least 1 (got {args.nproc})")
    if not 0 < args.mfu <= 1:
        raise UserError("--mfu", f"must be in (0, 1] (got {args.mfu})")
    if not 0 <= args.headroom < 1:
        raise UserError("--headroom", f"must be in [0, 1) (got {args.headroom})")
    if args.ranks not in ("", "all"):
        raise UserError("--ranks", f"takes 'all' (got {args.ranks!r})")
    return args, config_overrides(rest)


def main(argv=None) -> int:
    print_notices_as_lines()
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        config = load_recipe(args.config)
        for key, value in overrides:
            apply_override(config, key, value)
        args.backend, args.device, args.nproc = launch_flags(args.config, backend=args.backend, device=args.device,
                                                             nproc=args.nproc)
        named = hardware.DEVICE_MEMORY.get(args.device.lower())
        backend = backends.for_device(args.backend, named[0] if named else None, config)
        backends.load(backend).prepare_config(config)
        target = dataclasses.replace(resolve_target(backend, args.device, args.nproc), headroom=args.headroom)
        recipe = args.config or DEFAULT_RECIPE
        with Estimator() as estimator:
            ranks = list(range(target.nproc)) if args.ranks == "all" else None
            report = estimate_config(config, target, ranks, estimator)
            print(render(report, args.mfu, recipe), flush=True)
            fitting = [] if report.fits else search(estimator, report)
        print(verdict(report, fitting), flush=True)
        return 0 if report.fits else 1
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    except EstimateFailed as err:
        print(f"error: the estimate failed: {err}", file=sys.stderr)
        return ESTIMATE_FAILED


if __name__ == "__main__":
    sys.exit(main())
