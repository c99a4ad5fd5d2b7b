"""`python -m portable_fsdp.run [--backend B] [--config recipe.py[:arg]] [--config.a.b=v ...]`

With no arguments: the tiny Llama on the bundled corpus, CPU, 2 local processes.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from portable_fsdp import backends

from portable_fsdp.config import accelerate as accelerate_launch
from portable_fsdp.cli import Parser, config_overrides, default_workdir
from portable_fsdp.config.schema import DEFAULT_RECIPE, apply_override, load_recipe
from portable_fsdp.errors import UserError, notify, print_notices_as_lines
from portable_fsdp.storage import remote as storage
from portable_fsdp.config.hf_import import apply_fsdp_file, apply_fsdp_option, apply_parallelism_config

# Accelerate launch's ParallelismConfig flags (`accelerate launch --use_parallelism_config
# --parallelism_config_cp_size 2 ...`), read with the meaning Accelerate gives them; ep_size as transformers' own.
PARALLELISM_FLAGS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "cp_comm_strategy",
                     "sp_size", "sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation",
                     "ep_size")


def parse_args(argv):
    parser = Parser(prog="python -m portable_fsdp.run", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=backends.CHOICES,
                        help="auto = xla on a TPU or when plan.xla is true, cuda when a GPU is present, else cpu; "
                             "xla = torch_xla; flax = JAX")
    parser.add_argument("--config", default=None, help=f"recipe file[:arg] (default: the bundled {DEFAULT_RECIPE})")
    parser.add_argument("--workdir", default=None, help=("where metrics and checkpoints go: a directory, or "
                                                         "s3://bucket/path or gs://bucket/path (default: "
                                                         "runs/<recipe>-<time>)"))
    parser.add_argument("--nproc", type=int, default=None, help="local worker processes (default: 2 on CPU, #GPUs on CUDA)")
    parser.add_argument("--fsdp", default=None, metavar="OPTIONS",
                        help='Hugging Face TrainingArguments\' fsdp: option words, e.g. "full_shard auto_wrap offload", '
                             'or true')
    parser.add_argument("--fsdp_config", default=None, help="a Hugging Face fsdp_config JSON or an Accelerate YAML")
    parallelism = parser.add_argument_group("Accelerate's ParallelismConfig flags (read with --use_parallelism_config)")
    parallelism.add_argument("--use_parallelism_config", action="store_true")
    for name in PARALLELISM_FLAGS:
        parallelism.add_argument(f"--parallelism_config_{name}", default=None, metavar="VALUE")
    args, rest = parser.parse_known_args(argv)
    return args, config_overrides(rest)


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


def main(argv=None) -> int:
    try:
        print_notices_as_lines()
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        config = load_recipe(args.config)
        if args.fsdp:
            apply_fsdp_option(config, args.fsdp)
        if args.fsdp_config:
            apply_fsdp_file(config, args.fsdp_config)
        apply_parallelism_flags(config, args)
        for key, value in overrides:
            apply_override(config, key, value)
        if args.nproc is not None and args.nproc < 1:
            raise UserError("--nproc", f"must be at least 1 (got {args.nproc})")
        from portable_fsdp.launch.launcher import under_torchrun

        nodes = accelerate_launch.from_file(args.fsdp_config, args.backend, args.nproc, under_torchrun())
        backend = backends.resolve(nodes.backend, config)
        if nodes.multi_node and nodes.backend == "auto":  # auto may resolve to xla only now (xla: true, a TPU)
            backends.load(backend).check_machines(nodes, args.fsdp_config)
        nproc = nodes.nproc if nodes.nproc is not None else backends.load(backend).default_nproc(backend)
        recipe = pathlib.Path((args.config or DEFAULT_RECIPE).partition(":")[0]).stem
        if nodes.multi_node and not args.workdir:
            raise UserError("--workdir", (f"num_machines: {nodes.num_machines} needs --workdir, one directory every "
                                          "machine writes to (a shared disk): checkpoints hold every rank's files"))
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
