"""Context parallelism on CPU: peak memory per rank as the sequence grows, the longest sequence each
setting trains within a per-rank memory budget, and tokens/s at one common length.

    python -m benchmarks.context_parallel [--budget-mb 1600] [--lengths 512,1024,2048,4096] [--common 1024]

Each cell is a fresh 4-process run (world 4: fsdp x cp) of a few steps of a 4-layer Llama, one
sequence per data-parallel rank; memory is the peak resident set of the busiest rank (it includes
~0.7 GB of libraries, the same for every setting).
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.common import parse_benchmark_args, ROOT, machine, run_cli, table, write_json

SETTINGS = [("cp=1", 1, "allgather"), ("cp=2 allgather", 2, "allgather"), ("cp=2 alltoall", 2, "alltoall"),
            ("cp=4 allgather", 4, "allgather"), ("cp=4 alltoall", 4, "alltoall")]
MODEL = ["--config.model.hidden_size=256", "--config.model.intermediate_size=704", "--config.model.num_hidden_layers=4",
         "--config.model.num_attention_heads=8", "--config.model.num_key_value_heads=4",
         "--config.model.max_position_embeddings=16384"]
WORLD = 4


def measure(cp: int, method: str, seq_len: int, steps: int) -> dict:
    dp = WORLD // cp
    records = run_cli([*MODEL, f"--config.plan.cp_size={cp}", f"--config.plan.cp_rotate_method={method}",
                       "--config.plan.cp_impl=portable", f"--config.data.seq_len={seq_len}",
                       f"--config.train.batch_size={dp}", f"--config.train.eval_batch_size={dp}",
                       f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
                       "--config.train.eval_max_batches=1", "--config.train.warmup_steps=1"], nproc=WORLD)
    train = [r for r in records if "loss" in r]
    return {"peak_mb": max(train[-1]["peak_mem_mb"]), "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mb", type=float, default=1600)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--common", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    args = parse_benchmark_args(parser)
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {}
    for name, cp, method in SETTINGS:
        for seq_len in sorted(set(lengths + [args.common])):
            try:
                results[(name, seq_len)] = measure(cp, method, seq_len, args.steps)
            except RuntimeError as err:
                results[(name, seq_len)] = {"error": str(err)}
            print(f"{name:16s} L={seq_len:6d} {results[(name, seq_len)]}", flush=True)
    rows = []
    for name, _, _ in SETTINGS:
        fits = [L for L in lengths if results[(name, L)].get("peak_mb", float("inf")) <= args.budget_mb]
        common = results[(name, args.common)]
        rows.append([name, *(f"{results[(name, L)].get('peak_mb', float('nan')):.0f}" for L in lengths),
                     max(fits) if fits else "-", f"{common.get('tokens_per_sec', float('nan')):,.0f}"])
    headers = ["setting", *(f"peak MB @{L}" for L in lengths), f"longest ≤ {args.budget_mb:.0f} MB",
               f"tokens/s @{args.common}"]
    print()
    print(table(headers, rows))
    write_json(ROOT / "benchmarks" / "results" / "context_parallel.json",
               {"machine": machine(), "budget_mb": args.budget_mb, "world_size": WORLD,
                "results": [{"setting": n, "seq_len": L, **v} for (n, L), v in results.items()]})


if __name__ == "__main__":
    main()
