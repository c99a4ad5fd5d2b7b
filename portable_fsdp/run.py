"""`python -m portable_fsdp.run [--backend B] [--config recipe.py[:arg]] [--config.a.b=v ...]`

With no arguments: the tiny Llama on the bundled corpus, CPU, 2 local processes.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap

from portable_fsdp import backends

from portable_fsdp.config import accelerate as accelerate_launch
from portable_fsdp.launch import cluster
from portable_fsdp.cli import Parser, config_overrides, default_workdir
from portable_fsdp.config.schema import (DEFAULT_RECIPE, apply_override, base_config, command_line_text, field_meanings,
                                         flat_fields, load_recipe)
from portable_fsdp.configs.hardware import launch_flags
from portable_fsdp.errors import UserError, notify, print_notices_as_lines
from portable_fsdp.machine import tpu_vm
from portable_fsdp.storage import remote as storage
from portable_fsdp.config.hf_import import apply_fsdp_file, apply_fsdp_option, apply_parallelism_config

# Accelerate launch's ParallelismConfig flags (`accelerate launch --use_parallelism_config
# --parallelism_config_cp_size 2 ...`), read with the meaning Accelerate gives them; ep_size as transformers' own.
PARALLELISM_FLAGS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "cp_comm_strategy",
                     "sp_size", "sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation",
                     "ep_size")


def parse_args(argv):
    parser = Parser(prog="python -m portable_fsdp.run", description=__doc__, epilog=fields_help(),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=backends.CHOICES,
                        help="auto = the recipe variant's, else xla on a TPU or when plan.xla is true, cuda when a "
                             "GPU is present, else cpu; xla = torch_xla; flax = JAX")
    parser.add_argument("--config", default=None, help=f"recipe file[:arg] (default: the bundled {DEFAULT_RECIPE})")
    parser.add_argument("--workdir", default=None, help=("where metrics and checkpoints go: a directory, or "
                                                         "s3://bucket/path or gs://bucket/path (default: "
                                                         "runs/<recipe>-<time>)"))
    parser.add_argument("--nproc", type=int, default=None,
                        help="local worker processes (default: the recipe variant's, else 2 on CPU, #GPUs on CUDA)")
    parser.add_argument("--fsdp", default=None, metavar="OPTIONS",
                        help='Hugging Face TrainingArguments\' fsdp: option words, e.g. "full_shard auto_wrap offload", '
                             'or true')
    parser.add_argument("--fsdp_config", default=None, help="a Hugging Face fsdp_config JSON or an Accelerate YAML")
    parser.add_argument("--print_config", action="store_true",
                        help="print the config the run would use (recipe, fsdp files and overrides applied) and exit")
    parallelism = parser.add_argument_group("Accelerate's ParallelismConfig flags (read with --use_parallelism_config)")
    parallelism.add_argument("--use_parallelism_config", action="store_true")
    for name in PARALLELISM_FLAGS:
        parallelism.add_argument(f"--parallelism_config_{name}", default=None, metavar="VALUE")
    args, rest = parser.parse_known_args(argv)
    return args, config_overrides(rest)


def fields_help() -> str:
    """Every config field with its default and meaning, from the schema (portable_fsdp/config/schema.py)."""
    defaults = flat_fields(base_config())
    entries = [f"  {field} = {shown(defaults[field])}\n"
               + textwrap.fill(meaning, 116, initial_indent=" " * 6, subsequent_indent=" " * 6)
               for field, meaning in field_meanings().items()]
    return "config fields (set any with --config.FIELD=VALUE; shown with their defaults):\n" + "\n".join(entries)


def shown(value) -> str:
    return command_line_text(value) or '""'  # an empty string stays visible


def print_config(config) -> None:
    for field, value in flat_fields(config).items():
        print(f"{field} = {shown(value)}")


def apply_parallelism_flags(config, args) -> None:
    """As Accelerate: the flags given count only with --use_parallelism_config."""
    given = {f"parallelism_config_{name}": getattr(args, f"parallelism_config_{name}") for name in PARALLELISM_FLAGS
             if getattr(args, f"parallelism_config_{name}") is not None}
    if not args.use_parallelism_config:
        if given:
            flags = ", ".join(f"--{flag}" for flag in given)
            notify(f"{flags} {'is' if len(given) == 1 else 'are'} ignored: Accelerate reads the "
                   "--parallelism_config_* flags only with --use_parallelism_config")
        return
    apply_parallelism_config(config, given, "--")


def _tpu_slice_hosts() -> tuple | None:
    """(hosts, who says so) on a TPU slice of several hosts, else None."""
    hosts = tpu_vm.slice_workers()[1]
    return (hosts, "TPU slice hosts") if hosts > 1 else None


def main(argv=None) -> int:
    try:
        print_notices_as_lines()
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cluster.become_rank(args.nproc)  # srun's one task per GPU: before anything asks whether this is a rank
        config = load_recipe(args.config)
        if args.fsdp:
            apply_fsdp_option(config, args.fsdp)
        if args.fsdp_config:
            apply_fsdp_file(config, args.fsdp_config)
        apply_parallelism_flags(config, args)
        for key, value in overrides:
            apply_override(config, key, value)
        if args.print_config:
            print_config(config)
            return 0
        if args.nproc is not None and args.nproc < 1:
            raise UserError("--nproc", f"must be at least 1 (got {args.nproc})")
        from portable_fsdp.launch.launcher import under_torchrun

        if args.fsdp_config is None and not under_torchrun():  # else torchrun or the file decides the launch
            args.backend, args.nproc = launch_flags(args.config, backend=args.backend, nproc=args.nproc)
        nodes = accelerate_launch.from_file(args.fsdp_config, args.backend, args.nproc, under_torchrun(),
                                            cluster.scheduler_machines())
        backend = backends.resolve(nodes.backend, config)
        if nodes.multi_node and nodes.backend == "auto":  # auto may resolve to xla only now (xla: true, a TPU)
            backends.load(backend).check_machines(nodes, args.fsdp_config)
        nproc = nodes.nproc if nodes.nproc is not None else backends.load(backend).default_nproc(backend)
        recipe = pathlib.Path((args.config or DEFAULT_RECIPE).partition(":")[0]).stem
        machines, named = (cluster.machines_reported() or _tpu_slice_hosts()
                           or (nodes.num_machines, "num_machines"))
        if machines > 1 and not args.workdir:  # each machine's time-stamped default workdir would differ
            raise UserError("--workdir", (f"{named}: {machines} needs --workdir, one directory every machine writes "
                                          "to (gs://bucket/run, or a shared mount): checkpoints hold every machine's "
                                          "files"))
        workdir = storage.working_copy(args.workdir) if storage.is_url(args.workdir) else \
            pathlib.Path(args.workdir) if args.workdir else default_workdir(recipe)
        from portable_fsdp.launch import launcher as launch

        launch.start(config, backend, workdir, nproc, nodes)
        return 0
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    except SystemExit as exit_:  # the run failed and its `error:` line is printed
        return exit_.code if isinstance(exit_.code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
