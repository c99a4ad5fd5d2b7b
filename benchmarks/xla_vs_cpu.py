"""The same job on `--backend xla` (SPMD FSDPv2 over PJRT CPU devices) and `--backend cpu` (FSDP2 over gloo
ranks): first-step time (on xla: mostly compilation), steady-state step time and tokens/s.

    python -m benchmarks.xla_vs_cpu [--steps 40] [--nproc 2] [--recipe portable_fsdp/configs/llama_tiny.py]

Each backend is one run of the command with `log_every=1`; a step's time is its tokens over the tokens/s
the metrics file records for it. Steady state is the median over the steps after the first `--warmup`.
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.common import parse_benchmark_args, ROOT, machine, run_cli, table, write_json


def measure(backend: str, recipe: str, nproc: int, steps: int, warmup: int) -> dict:
    records = run_cli(["--backend", backend, "--config", recipe, f"--config.train.steps={steps}",
                       "--config.train.log_every=1", "--config.train.eval_every=0",
                       "--config.train.eval_max_batches=1"], nproc=nproc)
    train = [r for r in records if "loss" in r]
    tokens = _tokens_per_step(recipe)
    seconds = [tokens / r["tokens_per_sec"] for r in train]
    steady = statistics.median(seconds[warmup:])
    return {"backend": backend, "ranks": nproc, "first_step_s": seconds[0], "second_step_s": seconds[1],
            "steady_step_ms": 1000 * steady, "tokens_per_sec": tokens / steady,
            "compile_s": sum(s - steady for s in seconds[:warmup]), "final_loss": train[-1]["loss"]}


def _tokens_per_step(recipe: str) -> int:
    from portable_fsdp.config.schema import load_recipe

    config = load_recipe(recipe)
    return config.train.batch_size * config.data.seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "portable_fsdp" / "configs" / "llama_tiny.py"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady state")
    parser.add_argument("--nproc", type=int, default=2)
    args = parse_benchmark_args(parser)
    results = [measure(backend, args.recipe, args.nproc, args.steps, args.warmup) for backend in ("xla", "cpu")]
    headers = ["backend", "ranks", "first step (s)", "second step (s)", f"steady step (ms, median of {args.steps - args.warmup})",
               "tokens/s", f"compile ≈ first {args.warmup} steps − steady (s)", "loss at end"]
    rows = [[r["backend"], r["ranks"], f"{r['first_step_s']:.2f}", f"{r['second_step_s']:.2f}",
             f"{r['steady_step_ms']:.1f}", f"{r['tokens_per_sec']:,.0f}", f"{r['compile_s']:.2f}",
             f"{r['final_loss']:.4f}"] for r in results]
    print(table(headers, rows))
    write_json(ROOT / "benchmarks" / "results" / "xla_vs_cpu.json",
               {"machine": machine(), "recipe": args.recipe, "steps": args.steps, "warmup": args.warmup,
                "results": results})


if __name__ == "__main__":
    main()
