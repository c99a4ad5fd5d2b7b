"""`python -m portable_fsdp.crosscheck --backends cpu,xla,flax --steps 20 [--config recipe[:arg]] [--config.a.b=v]`

Can I trust my loss on a new accelerator? Every backend trains from one set of initial weights (made
once, saved, and loaded by each backend through model.init_from — converted, never re-initialised) on
the same batches; the per-step losses go into one table, and into crosscheck.json and crosscheck.png in
--workdir (default runs/crosscheck-<time>). Config fields are set as for `python -m portable_fsdp.run`,
with --config.a.b=value, for every backend; --override BACKEND:a.b=value sets one for one backend. The exit status
is 1 when two backends differ by more than --rtol at any step (or a backend fails), else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from portable_fsdp import backends
from portable_fsdp.config.schema import DEFAULT_RECIPE, apply_override, load_recipe
from portable_fsdp.errors import UserError, print_notices_as_lines
from portable_fsdp.plot import pyplot, save_figure
from portable_fsdp.cli import Parser, config_overrides, default_workdir


def parse_args(argv):
    """-> (args, [(key, value)] from --config.a.b=value, as `python -m portable_fsdp.run` reads them)."""
    parser = Parser(prog="python -m portable_fsdp.crosscheck", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="cpu,xla,flax", help="comma-separated; the first is the reference")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default=f"{DEFAULT_RECIPE}:test", help="recipe[:arg] (default: llama_tiny:test)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks / devices per backend")
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference allowed (fp32)")
    parser.add_argument("--workdir", default=None,
                        help="where crosscheck.json and crosscheck.png go (default: runs/crosscheck-<time>)")
    parser.add_argument("--override", action="append", default=[], metavar="BACKEND:KEY=VALUE",
                        help="a config override for one backend only (e.g. to check that a difference is caught)")
    args, rest = parser.parse_known_args(argv)
    return args, config_overrides(rest)


def _split_override(text: str):
    backend, sep, rest = text.partition(":")
    key, eq, value = rest.partition("=")
    if not sep or not eq:
        raise UserError("--override", f"{text!r}: write BACKEND:key=value, e.g. flax:train.lr=0.01")
    return backend, key, value


def initial_weights(config_spec: str, overrides: list, directory: pathlib.Path) -> None:
    """The one set of initial weights every backend starts from (the torch backends' seeded init)."""
    from portable_fsdp.backends.hf_torch.model import create_model

    config = load_recipe(config_spec)
    for key, value in overrides:
        apply_override(config, key, value)
    create_model(config, rank=0, rank0_only=False).save_pretrained(directory)


# Fields crosscheck sets on every run itself, to log one loss per step for --steps steps.
RUN_FIELDS = {"train.steps": "is set by crosscheck; use --steps", "train.log_every": "is set by crosscheck (every step)"}


def run_backend(name: str, args, overrides: list, weights: pathlib.Path, workdir: pathlib.Path) -> dict:
    command = [sys.executable, "-m", "portable_fsdp.run", "--backend", name, "--config", args.config,
               "--workdir", str(workdir), "--nproc", str(args.nproc), f"--config.train.steps={args.steps}",
               "--config.train.log_every=1", "--config.train.progress_bar=false", f"--config.model.init_from={weights}"]
    command += [f"--config.{key}={value}" for key, value in overrides]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "USE_TORCH_XLA": "0"})
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()[-1:]
        return {"status": f"failed: {lines[-1] if lines else proc.returncode}"}
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    if len(losses) != args.steps:  # e.g. train.stop_at_step or early stopping ended it sooner
        return {"status": f"failed: logged {len(losses)} of {args.steps} steps"}
    return {"status": "ok", "losses": losses}


def compare(results: dict, steps: int) -> list:
    """Per step: every backend's loss and the largest relative difference to the first backend that ran."""
    ran = [name for name, r in results.items() if r["status"] == "ok"]
    rows = []
    for step in range(steps):
        losses = {name: results[name]["losses"][step] for name in ran}
        reference = losses[ran[0]] if ran else None
        worst = max((abs(v - reference) / abs(reference) for v in losses.values()), default=0.0)
        rows.append({"step": step + 1, "losses": losses, "max_rel_diff": worst})
    return rows


def render(results: dict, rows: list, rtol: float) -> str:
    names = list(results)
    header = ["step", *names, "max rel diff"]
    body = [[str(r["step"]), *(f"{r['losses'][n]:.6f}" if n in r["losses"] else results[n]["status"] for n in names),
             f"{r['max_rel_diff']:.2e}{'  <-- over rtol' if r['max_rel_diff'] > rtol else ''}"] for r in rows]
    widths = [max(len(x) for x in column) for column in zip(header, *body)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), *map(fmt, body)])


def plot(results: dict, rows: list, path: pathlib.Path, title: str) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    steps = [r["step"] for r in rows]
    for name, result in results.items():
        if result["status"] == "ok":
            top.plot(steps, result["losses"], marker=".", label=name)
    top.set_ylabel("training loss")
    top.legend()
    bottom.semilogy(steps, [max(r["max_rel_diff"], 1e-12) for r in rows], color="black")
    bottom.set_ylabel("max relative diff")
    bottom.set_xlabel("step")
    save_figure(fig, path, title)


def main(argv=None) -> int:
    print_notices_as_lines()
    try:
        args, shared = parse_args(sys.argv[1:] if argv is None else argv)
        names = [n.strip() for n in args.backends.split(",") if n.strip()]
        for name in names:
            if name not in backends.BACKENDS:
                raise UserError("--backends", f"unknown backend {name!r}; choose from {', '.join(backends.BACKENDS)}")
        per_backend = [_split_override(s) for s in args.override]
        for key in [k for k, _ in shared] + [k for _, k, _ in per_backend]:
            if key in RUN_FIELDS:
                raise UserError(f"config.{key}", RUN_FIELDS[key])
        workdir = pathlib.Path(args.workdir) if args.workdir else default_workdir("crosscheck")
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError("--workdir", f"cannot create {workdir} ({err.strerror}); choose another directory") from None
        with tempfile.TemporaryDirectory() as scratch:
            scratch = pathlib.Path(scratch)
            initial_weights(args.config, shared, scratch / "weights")
            results = {}
            for name in names:
                mine = shared + [(k, v) for b, k, v in per_backend if b == name]
                results[name] = run_backend(name, args, mine, scratch / "weights", scratch / name)
                print(f"{name}: {results[name]['status']}", file=sys.stderr, flush=True)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    rows = compare(results, args.steps)
    worst = max((r["max_rel_diff"] for r in rows), default=0.0)
    failed = [n for n, r in results.items() if r["status"].startswith("failed")]
    out = workdir / "crosscheck"
    summary = {"config": args.config, "steps": args.steps, "rtol": args.rtol,
               "overrides": [f"config.{k}={v}" for k, v in shared] + args.override,
               "backends": {n: r for n, r in results.items()}, "rows": rows, "max_rel_diff": worst,
               "agree": worst <= args.rtol and not failed}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    if sum(r["status"] == "ok" for r in results.values()):
        plot(results, rows, out.with_suffix(".png"),
             f"{args.config}, {args.nproc} ranks/devices; max rel diff {worst:.1e} (rtol {args.rtol:.0e})")
    print(render(results, rows, args.rtol))
    verdict = "agree" if summary["agree"] else "DISAGREE"
    print(f"\n{verdict}: largest relative difference {worst:.2e} (rtol {args.rtol:.0e}) over {args.steps} steps; "
          + "; ".join(f"{n}: {r['status']}" for n, r in results.items())
          + f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0 if summary["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
