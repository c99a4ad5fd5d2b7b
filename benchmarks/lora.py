"""LoRA adapters (model.peft) against full fine-tuning of the same model: memory per rank and tokens/s, 2 CPU ranks
(FSDP2 over gloo), both measured in this run.

    python -m benchmarks.lora            # a ~18M-parameter Llama, 12 steps each (~3 min on 2 cores)
    python -m benchmarks.lora --quick    # the tiny test model, 3 steps: checks the script works

Each variant is one `python -m portable_fsdp.run --nproc 2` from the same seeded weights on the same batches. From
its metrics.jsonl: parameters + optimizer state (`state_mb`) and gradients (`grad_mb`) per rank after the last
step, the largest peak resident set of a rank (`peak_mem_mb`: a CPU process's, libraries included) and what it held
before the model existed (`base_mem_mb`: libraries, peft's among them, and the process group), and the median
tokens/s of the steps after the first two (lazy initialisation, AdamW's state created). Beside them, the peak of
rank 0's tensors in one step as the estimator traces the same lowering (portable_fsdp.estimate): a CPU process's
resident set also holds what the allocator keeps of freed blocks. Results: benchmarks/results/lora.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.common import ROOT, TINY_MODEL, run_cli, table, write_json

# ~18M parameters: 6 layers of 512 / 1376, the byte tokenizer's 384-token vocabulary
MODEL = ["--config.model.hidden_size=512", "--config.model.intermediate_size=1376",
         "--config.model.num_hidden_layers=6", "--config.model.num_attention_heads=8",
         "--config.model.num_key_value_heads=4"]
LORA = ["--config.model.peft.type=lora", "--config.model.peft.r=8",
        "--config.model.peft.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
VARIANTS = {"full fine-tuning": [], "LoRA r=8, every Linear of the layers": LORA}


SHAPE = ["--config.train.batch_size=8", "--config.data.seq_len=256"]


def traced_peak_mb(flags: list, estimator) -> float:
    """The estimator's peak of rank 0's tensors in the step (portable_fsdp.estimate: the lowering traced)."""
    from portable_fsdp import estimate
    from portable_fsdp.config.schema import apply_override, load_recipe

    config = load_recipe(None)
    for flag in flags:
        key, _, value = flag.removeprefix("--config.").partition("=")
        apply_override(config, key, value)
    report = estimate.estimate_config(config, estimate.resolve_target("cpu", "cpu", 2), [0], estimator)
    return report.result["ranks"][0]["peak"] / 2**20


def measure(model: list, steps: int, extra: list) -> dict:
    records = run_cli([*model, *SHAPE, f"--config.train.steps={steps}", "--config.train.log_every=1",
                       "--config.train.eval_every=0", "--config.train.save_every=0", "--config.train.keep_last_n=1",
                       *extra], nproc=2)
    train = [r for r in records if "loss" in r]
    last = train[-1]
    return {"state_mb": max(last["state_mb"]), "grad_mb": max(last["grad_mb"]),
            "peak_mem_mb": max(max(r["peak_mem_mb"]) for r in train), "base_mem_mb": max(last["base_mem_mb"]),
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train[2:] or train),
            "losses": [r["loss"] for r in train]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny test model, 3 steps: measures nothing")
    args = parser.parse_args()
    model, steps = (TINY_MODEL, 3) if args.quick else (MODEL, 12)
    from portable_fsdp import estimate

    results = {}
    with estimate.Estimator() as estimator:
        for name, extra in VARIANTS.items():
            results[name] = {**measure(model, steps, extra),
                             "traced_peak_mb": traced_peak_mb([*model, *SHAPE, *extra], estimator)}
            print(f"{name}: done", file=sys.stderr, flush=True)
    full = results["full fine-tuning"]
    def training_mb(r):  # the peak above what the process held before the model existed (libraries, groups)
        return r["peak_mem_mb"] - r["base_mem_mb"]

    rows = [[name, f"{r['state_mb']:.1f}", f"{r['grad_mb']:.1f}", f"{r['traced_peak_mb']:.0f}",
             f"{r['traced_peak_mb'] / full['traced_peak_mb']:.2f}", f"{r['base_mem_mb']:.0f}", f"{r['peak_mem_mb']:.0f}",
             f"{training_mb(r):.0f}", f"{training_mb(r) / training_mb(full):.2f}", f"{r['tokens_per_sec']:,.0f}",
             f"{r['tokens_per_sec'] / full['tokens_per_sec']:.2f}"] for name, r in results.items()]
    print(table(["variant", "params + optimizer MiB/rank", "gradients MiB/rank", "tensors' peak MiB/rank (traced)",
                 "traced / full", "RSS before the model MiB/rank", "peak RSS MiB/rank", "peak - before",
                 "(peak - before) / full", "tokens/s", "tokens/s / full"], rows))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "lora.json", {"model": MODEL, "steps": steps, "results": results})


if __name__ == "__main__":
    main()
