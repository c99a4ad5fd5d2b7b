"""Peak memory of one training step with the loss computed a chunk of tokens at a time (train.loss_chunk_tokens)
against the whole micro-batch's logits at once (0), on CPU, for real tokenizers' vocabulary sizes.

    python -m benchmarks.loss_memory            # vocabularies 32,000 and 128,256 at 4,096 tokens (~3 min)
    python -m benchmarks.loss_memory --quick    # a small vocabulary and few tokens: checks the script works

Each cell is a fresh process running the torch backend in a world of one rank (the plain module) on a small
Llama (hidden 256, 2 layers): one step to create AdamW's state, then the measured step, its peak resident set
(VmHWM, reset just before it) minus the resident set before it — the step's own memory: activations, logits,
gradients. glibc's mmap threshold is fixed at 1 MB so that freed tensors leave the resident set at once. The
fp32 logits of the micro-batch, tokens × vocabulary × 4 bytes, are shown for scale. Results:
benchmarks/results/loss_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.common import ROOT, free_port, run_python, table, write_json

VOCABULARIES = (32_000, 128_256)  # Llama 2's and Llama 3's tokenizers
QUICK_VOCABULARIES = (1_000,)
MODEL = ["--config.model.hidden_size=256", "--config.model.intermediate_size=704",
         "--config.model.num_hidden_layers=2", "--config.model.num_attention_heads=4",
         "--config.model.num_key_value_heads=2", "--config.model.max_position_embeddings=4096"]
CHUNKS = (0, 1024)  # the whole micro-batch; the default chunk


def _hwm_reset() -> None:
    """Reset this process's peak resident set (VmHWM) to its current one (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(key + ":"))
    return int(line.split()[1]) / 2**10


def _worker(spec: dict) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    from portable_fsdp import backends
    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.data.loader import TrainBatches, build_token_data
    from portable_fsdp.config.validate import resolve_plan

    config = load_recipe(None)
    for flag in spec["flags"]:
        key, _, value = flag.removeprefix("--config.").partition("=")
        apply_override(config, key, value)
    backend = backends.load("cpu")
    state = backend.init(config, resolve_plan(config, 1), "cpu")
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed, None)
    state, _ = backend.train_step(state, batches.micro_batches(0, 0, 1))  # AdamW's state now exists
    before = _status_mb("VmRSS")
    _hwm_reset()
    began = time.perf_counter()
    state, metrics = backend.train_step(state, batches.micro_batches(1, 0, 1))
    seconds = time.perf_counter() - began
    result = {"step_mb": _status_mb("VmHWM") - before, "seconds": seconds, "loss": metrics["loss"]}
    backend.finalize(state)
    return result


def measure(vocab: int, tokens: int, chunk: int, seq_len: int) -> dict:
    flags = [*MODEL, f"--config.model.vocab_size={vocab}", f"--config.data.seq_len={seq_len}",
             f"--config.train.batch_size={tokens // seq_len}", f"--config.train.loss_chunk_tokens={chunk}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        proc = run_python(["-m", "benchmarks.loss_memory", "--worker", json.dumps({"flags": flags, "out": out})],
                          timeout=1200, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "2"})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
        return json.loads(open(out).read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small vocabulary and few tokens: measures nothing")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per cell (median)")
    parser.add_argument("--worker", help="internal: one measurement's JSON spec")
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        result = _worker(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return
    vocabularies, tokens, seq_len = (QUICK_VOCABULARIES, 256, 128) if args.quick else (VOCABULARIES, 4096, 2048)
    rows, results = [], []
    for vocab in vocabularies:
        cells = {}
        for chunk in CHUNKS:
            runs = [measure(vocab, tokens, chunk, seq_len) for _ in range(1 if args.quick else args.repeats)]
            cells[chunk] = {"step_mb": statistics.median(r["step_mb"] for r in runs),
                            "seconds": statistics.median(r["seconds"] for r in runs), "loss": runs[0]["loss"],
                            "runs": runs}
            print(f"vocab {vocab:,} chunk {chunk}: {cells[chunk]['step_mb']:,.0f} MB, "
                  f"{cells[chunk]['seconds']:.2f} s", flush=True, file=sys.stderr)
        whole, chunked = cells[0], cells[CHUNKS[1]]
        logits_mb = tokens * vocab * 4 / 2**20
        results.append({"vocab": vocab, "tokens": tokens, "logits_fp32_mb": logits_mb, "cells": cells})
        rows.append([f"{vocab:,}", f"{tokens:,}", f"{logits_mb:,.0f}", f"{whole['step_mb']:,.0f}",
                     f"{chunked['step_mb']:,.0f}", f"{chunked['step_mb'] / whole['step_mb']:.2f}",
                     f"{whole['seconds']:.2f} / {chunked['seconds']:.2f}",
                     f"{abs(chunked['loss'] - whole['loss']) / whole['loss']:.1e}"])
    print(table(["vocabulary", "tokens", "fp32 logits MB", "step peak MB, whole logits",
                 f"step peak MB, chunks of {CHUNKS[1]}", "chunked / whole", "step s whole / chunked",
                 "loss rel. diff"], rows))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "loss_memory.json", {"model": MODEL, "results": results})


if __name__ == "__main__":
    main()
