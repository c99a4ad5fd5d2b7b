"""How close the memory estimate (`python -m portable_fsdp.estimate`) comes to real runs: predicted against
measured, per rank, for small Llamas trained on CPU at world 1, 2 and 4.

    python -m benchmarks.estimate_accuracy [--quick] [--config.a.b=v ...]

Measured: a fresh `python -m portable_fsdp.run --backend cpu` of 3 steps, its memory report after the third
(before the final eval and checkpoint): `state_mb` (parameters + AdamW state the rank holds), `grad_mb` (its
gradient shards) and the training peak — the rank's peak resident set less what the process held before the
model existed (`base_mem_mb`: libraries, process group) and less shared memory (`shm_mb`). FSDP's collectives
take gloo's path (plan.cpu_collectives=gloo), as the estimate assumes. Predicted: the estimate of the same
config for --backend cpu at that world size (rank 0).

Each run is measured twice. With glibc's allocator as it comes, the resident set keeps memory that tensors no
longer use: blocks under its (dynamic, up to 32 MiB) mmap threshold come from heap arenas that are seldom
returned, and the autograd engine's thread allocates from an arena of its own, so backward's temporaries do not
reuse what forward's activations freed. With MALLOC_MMAP_THRESHOLD_=131072 every block of 128 KiB or more is
mapped on allocation and unmapped on free, so the resident set follows the live tensors: that run compares like
with like (the estimate counts tensors). What remains besides tensors — first-use buffers of the kernels,
the unsharded model every rank builds before `fully_shard` — is small for these models, chosen so that
training, not start-up, sets the peak.
"""
from __future__ import annotations

import argparse
import json

from benchmarks.common import (ROOT, TINY_MODEL, config_from_flags, machine, parse_benchmark_args, run_cli, table,
                               write_json)

MODELS = {
    # name: model flags; sequence 512, global batch 8, fp32 — activations dominate, as in real training
    "3M": ["--config.model.hidden_size=256", "--config.model.intermediate_size=688",
           "--config.model.num_hidden_layers=4", "--config.model.num_attention_heads=4",
           "--config.model.num_key_value_heads=2"],
    "12M": ["--config.model.hidden_size=512", "--config.model.intermediate_size=1376",
            "--config.model.num_hidden_layers=4", "--config.model.num_attention_heads=8",
            "--config.model.num_key_value_heads=4"],
}
TRAINING = ["--config.data.seq_len=512", "--config.train.batch_size=8", "--config.train.eval_batch_size=8",
            "--config.train.steps=3", "--config.train.log_every=1", "--config.train.eval_every=0",
            "--config.train.eval_max_batches=1", "--config.train.warmup_steps=1", "--config.plan.cpu_collectives=gloo"]
WORLDS = (1, 2, 4)
MiB = 2**20
RETURNING_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def measured(flags: list, world: int, env: dict | None = None) -> dict:
    records = [r for r in run_cli(flags, nproc=world, env=env) if "loss" in r]
    last = records[-1]
    ranks = range(world)
    return {"state_mb": last["state_mb"][0], "grad_mb": last["grad_mb"][0],
            "peak_mb": [last["peak_mem_mb"][r] - last["base_mem_mb"][r] - last["shm_mb"][r] for r in ranks],
            "rss_mb": last["peak_mem_mb"], "base_mb": last["base_mem_mb"]}


def predicted(estimator, flags: list, world: int) -> dict:
    from portable_fsdp import estimate

    config = config_from_flags(flags)
    report = estimate.estimate_config(config, estimate.resolve_target("cpu", "cpu", world), [0], estimator)
    rank = report.result["ranks"][0]
    held = rank["held"]
    return {"state_mb": (held["parameters"] + held["optimizer"]) / MiB, "grad_mb": held["gradients"] / MiB,
            "peak_mb": rank["peak"] / MiB, "at_peak_mb": {k: round(v / MiB, 2) for k, v in rank["at_peak"].items()}}


HEADERS = ["model", "world", "state est (MiB)", "state run", "grads est", "grads run", "peak est",
           "peak run (returning allocator)", "vs est", "peak run (default allocator)", "vs est"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model at world 1 and 2: checks the benchmark runs")
    args = parse_benchmark_args(parser)
    from portable_fsdp import estimate

    models = {"tiny": TINY_MODEL} if args.quick else MODELS
    worlds = (1, 2) if args.quick else WORLDS
    results, rows = [], []
    with estimate.Estimator() as estimator:
        for name, model in models.items():
            for world in worlds:
                flags = [*model, *TRAINING]
                guess = predicted(estimator, flags, world)
                real, returning = measured(flags, world), measured(flags, world, RETURNING_ALLOCATOR)
                results.append({"model": name, "world": world, "predicted": guess, "measured": real,
                                "measured_returning_allocator": returning})
                peak, tensors = max(real["peak_mb"]), max(returning["peak_mb"])
                rows.append([name, world, f"{guess['state_mb']:.2f}", f"{returning['state_mb']:.2f}",
                             f"{guess['grad_mb']:.2f}", f"{returning['grad_mb']:.2f}", f"{guess['peak_mb']:.1f}",
                             f"{tensors:.1f}", f"{tensors / guess['peak_mb'] - 1:+.1%}", f"{peak:.1f}",
                             f"{peak / guess['peak_mb'] - 1:+.1%}"])
                print(table(HEADERS, rows[-1:]), flush=True)
    print()
    print(table(HEADERS, rows))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "estimate_accuracy.json", {"machine": machine(), "results": results})
    else:
        print(json.dumps(results[-1], indent=1))


if __name__ == "__main__":
    main()
