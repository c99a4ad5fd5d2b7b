"""On one H200 (or more): `--backend cuda` training of a smoke-size and a ~1B Llama in bf16, eager, with compiled
layers and with float8 layers, next to Hugging Face Trainer on the same GPU; then context parallelism with
cp_impl=torch against cp_impl=portable at a long sequence. Made to finish within 8 minutes.

On the GPU machine (nothing is downloaded there; torch is assumed, everything else comes from a folder of wheels
prepared where there is a network — benchmarks/gpu_setup.py):

    python -m benchmarks.gpu_setup install && python -m portable_fsdp.selftest && python -m benchmarks.gpu

Without a GPU, the same code with a tiny model on `--backend cpu` (layers compiled on CPU; the float8 rows
report the one-line refusal --backend cpu gives):  python -m benchmarks.gpu --dry-run-cpu

1. Training, `python -m portable_fsdp.run --backend cuda --nproc 1` per row: plan.param_dtype and
   plan.reduce_dtype bfloat16 (however the product lowers them on one rank), a few steps, for each model (the
   ~1B first) and each setting — eager, plan.compile, plan.compile + plan.float8 — then Hugging Face Trainer (benchmarks/hf_trainer.py: FSDP2 on one rank, `bf16`,
   fused AdamW, the same model, data and batch). Tokens/s and MFU of the median step after the first (the first
   compiles), MFU as the product counts it (portable_fsdp.training.metrics.flops_per_token against the datasheet's dense
   bf16 peak, portable_fsdp.machine.hardware; Trainer's rows against the same peak; float8 rows too, as torchtitan
   counts them), peak torch.cuda.max_memory_allocated.
2. Context parallelism needs cp_size >= 2 ranks, and NCCL will not put two ranks on one GPU. With >= 2 GPUs:
   full training steps with --nproc 2 --config.plan.cp_size=2 for each setting. With one GPU: in a process of
   its own, a 1-rank process group (so no communication), one decoder layer of the same model at the long
   sequence, forward + backward through the step's own pieces (apply_context_parallel, sequence_shard,
   token_loss_sum): the per-rank attention compute and memory of each implementation.

3. The mesh (benchmarks/mesh.py's table on --backend cuda): bytes per collective against each axis's formula,
   memory per rank and tokens/s for fsdp4, fsdp2 x tp2, tp4, hsdp 2x2, sp4 vs cp4 and a Mixtral at fsdp4 / ep2 /
   ep4 — on a machine with 4 or more GPUs (outside the 8-minute budget, which is sized for one GPU); skipped with
   fewer. The dry run checks it with two settings of a tiny model.

Rows run in that order within the budget; a row it cannot fit says "not run: the time budget is spent".
Results: three tables, and JSON in benchmarks/results/gpu.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

from benchmarks.common import (parse_benchmark_args, ROOT, attempt, config_from_flags, error_line, free_port,
                               fsdp_prefetch, machine, run_cli, run_python, table, write_json)

INSTALL = "python -m benchmarks.gpu_setup install"
BUDGET_S = 450  # the machine allows 8 minutes: every sub-run's timeout is cut to what is left of this
TRAIN_S, HF_S, CP_RUN_S, ONE_RANK_S = 150, 120, 150, 90  # each sub-run's own limit
# Our rows: plan settings on top of bf16 compute on one rank.
SETTINGS = [("eager", []), ("compile", ["--config.plan.compile=true"]),
            ("compile + float8", ["--config.plan.compile=true", "--config.plan.float8=true"])]
# Models of the training table, largest first (the budget cuts from the end).
MODELS = {
    # 22 layers of hidden 2048 (MLP 5632, 16 query / 8 kv heads of 128): ~1.04B parameters.
    "gpu": [("~1B", dict(hidden=2048, intermediate=5632, layers=22, heads=16, kv_heads=8, seq_len=2048, batch=8,
                         steps=8)),
            ("smoke", dict(hidden=64, intermediate=160, layers=2, heads=4, kv_heads=2, seq_len=256, batch=8, steps=8))],
    "cpu": [("smoke", dict(hidden=64, intermediate=160, layers=2, heads=4, kv_heads=2, seq_len=64, batch=2, steps=4))],
}
# On one rank the ring ("alltoall") still passes its dK/dV round, to itself: NCCL allows that, gloo (the
# dry run) does not, so that dry-run row fails.
CP_SETTINGS = [("torch", "allgather"), ("portable", "allgather"), ("portable", "alltoall")]
# The context-parallel section's model (the ~1B's layers) and its long sequence.
SIZES = {
    "gpu": dict(hidden=2048, intermediate=5632, layers=22, heads=16, kv_heads=8, long_seq=32768, cp_steps=4,
                repeats=3),
    "cpu": dict(hidden=64, intermediate=160, layers=2, heads=4, kv_heads=2, long_seq=256, cp_steps=3, repeats=2),
}


def model_flags(size: dict, layers: int | None = None) -> list:
    return [f"--config.model.hidden_size={size['hidden']}",
            f"--config.model.intermediate_size={size['intermediate']}",
            f"--config.model.num_hidden_layers={layers or size['layers']}",
            f"--config.model.num_attention_heads={size['heads']}",
            f"--config.model.num_key_value_heads={size['kv_heads']}",
            f"--config.model.max_position_embeddings={size.get('long_seq', size.get('seq_len'))}"]


def run_flags(size: dict, backend: str, seq_len: int, batch: int, steps: int) -> list:
    """bf16 compute and reductions on `backend`, as the product lowers them for the world it runs; MFU against
    the product's peak (the datasheet's on a known GPU)."""
    return ["--backend", backend, *model_flags(size), "--config.plan.param_dtype=bfloat16",
            "--config.plan.reduce_dtype=bfloat16", f"--config.data.seq_len={seq_len}",
            f"--config.train.batch_size={batch}", f"--config.train.eval_batch_size={batch}",
            f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
            "--config.train.eval_max_batches=1", "--config.train.warmup_steps=1", "--config.train.lr=3e-4"]


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def timeout(self, limit: float) -> float:
        left = self.end - time.monotonic()
        if left < 30:
            raise TimeoutError("not run: the time budget is spent")
        return min(limit, left)


def steady(records: list, tokens_per_step: int) -> dict:
    """Medians over the steps after the first (which pays for allocation and kernel selection)."""
    steps = [r for r in records if "loss" in r][1:]
    tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in steps)
    return {"step_ms": 1000 * tokens_per_step / tokens_per_sec, "tokens_per_sec": tokens_per_sec,
            "mfu": statistics.median(r["mfu"] for r in steps),
            "peak_mem_mb": max(max(r["peak_mem_mb"]) for r in steps)}


def cell(result: dict, key: str, fmt: str) -> str:
    return fmt.format(result[key]) if key in result else "-"


def train_flags(size: dict, setting: list, backend: str) -> list:
    return [*run_flags(size, backend, size["seq_len"], size["batch"], size["steps"]), *setting]


def train(size: dict, setting: list, backend: str, budget: Budget) -> dict:
    """One of our rows: `setting`'s plan flags on one rank."""
    records = run_cli(train_flags(size, setting, backend), nproc=1, timeout=budget.timeout(TRAIN_S))
    return steady(records, size["seq_len"] * size["batch"])


def hf_trainer(size: dict, backend: str, budget: Budget) -> dict:
    """Hugging Face Trainer's row: the same model, data, batch and steps, FSDP2 on one rank in bf16."""
    from benchmarks.hf_trainer import run_hf_trainer

    result = run_hf_trainer(model_flags(size), size["seq_len"], size["batch"], size["steps"], nproc=1,
                            timeout=budget.timeout(HF_S), device=backend, bf16=True)
    tokens_per_sec = result["tokens_per_sec"]
    return {"step_ms": 1000 * size["seq_len"] * size["batch"] / tokens_per_sec, "tokens_per_sec": tokens_per_sec,
            "peak_mem_mb": result["peak_mem_mb"], "final_loss": result["final_loss"]}


def with_mfu(rows: list, size: dict) -> None:
    """Trainer's MFU against the peak our rows of the same model used (the run's own rule: the datasheet on a
    known GPU, a measured matmul on the CPU): peak = FLOPs per token x tokens/s / MFU of one of our rows."""
    from portable_fsdp.backends.hf_torch.model import describe_model
    from portable_fsdp.training.metrics import flops_per_token

    info = describe_model(config_from_flags(model_flags(size)))
    per_token = flops_per_token(info, size["seq_len"])
    ours = next((r for r in rows if r.get("mfu") and r["setting"] != "HF Trainer"), None)
    for row in rows:
        if ours and row["setting"] == "HF Trainer" and "tokens_per_sec" in row:
            row["mfu"] = row["tokens_per_sec"] / ours["tokens_per_sec"] * ours["mfu"]
        row.update(n_params=info.n_params, flops_per_token=per_token)


def training_rows(label: str, size: dict, backend: str, budget: Budget) -> list:
    rows = []
    for name, setting in SETTINGS:
        prefetch = fsdp_prefetch(train_flags(size, setting, backend), 1, backend)
        rows.append({"model": label, "setting": name, "fsdp_prefetch": prefetch,
                     **attempt(train, size, setting, backend, budget)})
        print(f"training: {rows[-1]}", flush=True)
    rows.append({"model": label, "setting": "HF Trainer", **attempt(hf_trainer, size, backend, budget)})
    with_mfu(rows, size)
    print(f"training: {rows[-1]}", flush=True)
    return rows


def parameters(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"


def training_table(rows: list) -> str:
    trainer = {r["model"]: r.get("tokens_per_sec") for r in rows if r["setting"] == "HF Trainer"}

    def versus(row):
        base = trainer.get(row["model"])
        return f"{row['tokens_per_sec'] / base:.2f}x" if base and "tokens_per_sec" in row else "-"

    return table(["model", "setting", "FSDP prefetch", "step (ms, median)", "tokens/s", "MFU", "peak MB",
                  "vs HF Trainer", "error"],
                 [[f"{r['model']} ({parameters(r['n_params'])})", r["setting"], r.get("fsdp_prefetch", "-"),
                   cell(r, "step_ms", "{:.0f}"), cell(r, "tokens_per_sec", "{:,.0f}"), cell(r, "mfu", "{:.1%}"),
                   cell(r, "peak_mem_mb", "{:.0f}"), versus(r), r.get("error", "")] for r in rows])


def cp_flags(impl: str, method: str, size: dict, backend: str) -> list:
    return [*run_flags(size, backend, size["long_seq"], 1, size["cp_steps"]), "--config.plan.cp_size=2",
            f"--config.plan.cp_impl={impl}", f"--config.plan.cp_rotate_method={method}"]


def cp_ranks(impl: str, method: str, size: dict, backend: str, budget: Budget) -> dict:
    flags = cp_flags(impl, method, size, backend)
    return steady(run_cli(flags, nproc=2, timeout=budget.timeout(CP_RUN_S)), size["long_seq"])


def cp_one_rank(impl: str, method: str, size: dict, backend: str, budget: Budget) -> dict:
    """In a child process, so that an out-of-memory or a hang costs one row and the timeout can end it."""
    dry = ["--dry-run-cpu"] if backend == "cpu" else []
    proc = run_python(["-m", "benchmarks.gpu", "--one-rank-cp", f"{impl},{method}", *dry], budget.timeout(ONE_RANK_S))
    if proc.returncode != 0:
        raise RuntimeError(error_line(proc.stderr))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_rank_attention(impl: str, method: str, size: dict, backend: str) -> dict:
    """The child's work: forward + backward of one decoder layer at the long sequence on a 1-rank cp group."""
    import numpy as np
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from portable_fsdp.backends.hf_torch import model as model_lib
    from portable_fsdp.backends.hf_torch.loss import token_loss_sum
    from portable_fsdp.backends.torch import distributed
    from portable_fsdp.backends.torch.context_parallel import CPGroup, apply_context_parallel, sequence_shard
    from portable_fsdp.data.batch import Batch
    from portable_fsdp.plan import ShardingPlan

    port = free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    runtime = distributed.initialize(backend, 300)
    device = runtime.device
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
    # The plan's own check: on CPU it refuses cp_impl=torch with its one-line reason.
    cp = CPGroup(group=mesh.get_group(), mesh=mesh, cp_rank=0, cp_size=1, rotate_method=method,
                 impl=ShardingPlan(cp_impl=impl).resolved_cp_impl(device.type), load_balance=True)
    config = config_from_flags(model_flags(size, layers=1))
    model = model_lib.create_model(config, 0, False)
    apply_context_parallel(model, cp)
    model.to(device, torch.bfloat16)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (1, size["long_seq"] + 1))
    batch = Batch(input_ids=tokens[:, :-1].copy(), labels=tokens[:, 1:].copy())
    times = []
    for _ in range(1 + size["repeats"]):  # the first pass pays for kernel selection and allocation
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with sequence_shard(cp, batch, device) as (input_ids, labels, positions):
            token_loss_sum(model, input_ids, labels, positions).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
    distributed.shutdown()
    return {"step_ms": 1000 * statistics.median(times[1:]), "peak_mem_mb": peak}


def mesh_section(dry_run: bool, size: dict, backend: str, gpus: int) -> list:
    """benchmarks/mesh.py's table at world 4 on this machine's backend, fp32 as on CPU (its formulas count 4-byte
    activations), or [] without 4 GPUs."""
    from benchmarks import mesh

    if not dry_run and gpus < mesh.WORLD:
        print(f"\nMesh: skipped, it needs {mesh.WORLD} GPUs ({gpus} visible)")
        return []
    shape = mesh.QUICK if dry_run else dict(hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                                            num_hidden_layers=8, num_attention_heads=size["heads"],
                                            num_key_value_heads=size["kv_heads"])
    settings = mesh.SETTINGS[:2] if dry_run else mesh.SETTINGS
    failed = []
    rows = mesh.run_table(settings, shape, (64,) if dry_run else (2048, 16384), 3 if dry_run else 6, backend,
                          on_error=lambda setting, err: failed.append(f"{setting.name}: {err}"))
    print(f"\nMesh at world {mesh.WORLD} on --backend {backend}")
    print(mesh.report(rows))
    for line in failed:
        print(f"failed: {line}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny model on --backend cpu, to check the script")
    parser.add_argument("--one-rank-cp", help=argparse.SUPPRESS)  # IMPL,METHOD: the child of cp_one_rank
    args = parse_benchmark_args(parser)
    size, backend = (SIZES["cpu"], "cpu") if args.dry_run_cpu else (SIZES["gpu"], "cuda")
    import torch

    if backend == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device is visible; this benchmark needs a GPU (check it on CPU with --dry-run-cpu)")
    if importlib.util.find_spec("ml_collections") is None:
        sys.exit(f"error: ml_collections is not installed; run: {INSTALL}")
    if args.one_rank_cp:
        from portable_fsdp.errors import UserError

        try:
            print(json.dumps(one_rank_attention(*args.one_rank_cp.split(","), size, backend)))
        except UserError as err:
            sys.exit(err.line())
        return

    from portable_fsdp.machine.hardware import datasheet_flops

    budget = Budget(BUDGET_S)
    gpu = torch.cuda.get_device_name(0) if backend == "cuda" else None
    spec = datasheet_flops(gpu, "bfloat16") if gpu else None
    # A GPU machine runs the mode its GPU count allows; the dry run checks both.
    modes = ["ranks", "one-rank"] if args.dry_run_cpu else ["ranks" if torch.cuda.device_count() >= 2 else "one-rank"]
    what = {"ranks": f"full training steps, --nproc 2 cp_size=2, {size['layers']} layers",
            "one-rank": "a 1-rank process group, no communication: fwd+bwd of one decoder layer"}
    peak = f"{spec / 1e12:.0f} TFLOP/s (datasheet, dense bf16)" if spec else "the peak each run takes (a measured matmul)"
    print(f"{gpu or 'CPU (dry run)'}, torch {torch.__version__}; MFU against {peak}", flush=True)
    print("context parallelism mode: " + "; ".join(f"{m} ({what[m]})" for m in modes), flush=True)

    training = [row for label, model in MODELS[backend] for row in training_rows(label, model, backend, budget)]
    cp_results = []
    for mode in modes:
        measure = cp_ranks if mode == "ranks" else cp_one_rank
        for impl, method in CP_SETTINGS:
            flags = cp_flags(impl, method, size, backend)
            prefetch = fsdp_prefetch(flags, 2, backend) if mode == "ranks" else "no FSDP"
            result = {"mode": mode, "setting": f"{impl} {method}", "fsdp_prefetch": prefetch,
                      **attempt(measure, impl, method, size, backend, budget)}
            print(f"context parallel: {result}", flush=True)
            cp_results.append(result)

    print("\nTraining on one " + ("GPU" if gpu else "CPU process") + ": bf16, one rank; tokens/s and MFU of the "
          "median step after the first; float8 rows' MFU counts the same model FLOPs against the bf16 peak")
    print(training_table(training))
    for mode in modes:
        print(f"\nContext parallelism at seq {size['long_seq']}, mode {mode}: {what[mode]}")
        print(table(["setting", "FSDP prefetch", "ms (median)", "peak MB per rank", "error"],
                    [[r["setting"], r["fsdp_prefetch"], cell(r, "step_ms", "{:.0f}"),
                      cell(r, "peak_mem_mb", "{:.0f}"), r.get("error", "")]
                     for r in cp_results if r["mode"] == mode]))
    mesh_rows = mesh_section(args.dry_run_cpu, size, backend, torch.cuda.device_count())
    # A dry run leaves benchmarks/results alone.
    out = (pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_gpu_dry_run.json" if args.dry_run_cpu
           else ROOT / "benchmarks" / "results" / "gpu.json")
    write_json(out, {"machine": {**machine(), "gpu": gpu, "gpu_count": torch.cuda.device_count(),
                                 "cuda": torch.version.cuda},
                     "dry_run_cpu": args.dry_run_cpu, "models": dict(MODELS[backend]), "cp_size": size,
                     "spec_sheet_bf16": spec, "training": training,
                     "context_parallel": {"what": {m: what[m] for m in modes}, "results": cp_results},
                     "mesh": mesh_rows})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
