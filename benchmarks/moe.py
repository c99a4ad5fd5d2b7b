"""Mixture of experts on torch, 2 CPU ranks: tokens/s of ours (FSDP2, every expert on every rank; and ep 2, each
rank holding half of the experts) against Hugging Face Trainer (FSDP2 through Accelerate) on the same Qwen3-MoE,
runs alternated round by round so that the machine's drift cancels; and the FLOPs one step executes per token
(portable_fsdp/backends/torch/executed_flops.py) against what MFU assumes.

    python -m benchmarks.moe             # the smoke model and a 107M-parameter one (17 min on 2 busy cores)
    python -m benchmarks.moe --quick     # the smoke model, 3 steps, one round: checks the script works

Executed FLOPs are counted in this process on one batch of the benchmark's sequence length: the experts as ours
run them without expert parallelism (transformers' implementation that the lowering names, hf_torch/experts.py)
and with it (our local kernel, the experts split over a one-rank ep group). Results:
benchmarks/results/moe.json.
"""
from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.common import ROOT, config_from_flags, machine, parse_benchmark_args, run_cli, table, write_json
from benchmarks.hf_trainer import run_hf_trainer

# (hidden, layers, heads, kv heads, head dim, expert intermediate, experts, experts per token)
MODELS = {"smoke": (64, 2, 4, 2, 16, 32, 4, 2), "107M": (512, 8, 8, 4, 64, 512, 16, 2)}
SEQ_LEN, GLOBAL_BATCH = 256, 4
# (rounds, steps per run) per model
ROUNDS = {"smoke": (3, 8), "107M": (2, 5)}
VARIANTS = {"ours fsdp2": [], "ours ep2": ["--config.plan.ep_size=2"], "HF Trainer fsdp2": None}


def model_flags(size: str) -> list:
    hidden, layers, heads, kv_heads, head_dim, expert_size, experts, top_k = MODELS[size]
    overrides = {"head_dim": head_dim, "moe_intermediate_size": expert_size, "num_experts": experts,
                 "num_experts_per_tok": top_k, "norm_topk_prob": True, "output_router_logits": True,
                 "router_aux_loss_coef": 0.001}
    return ["--config.model.architecture=qwen3_moe", f"--config.model.hidden_size={hidden}",
            f"--config.model.num_hidden_layers={layers}", f"--config.model.num_attention_heads={heads}",
            f"--config.model.num_key_value_heads={kv_heads}", f"--config.model.config_overrides={json.dumps(overrides)}",
            "--config.train.warmup_steps=1"]  # Trainer's warm-up would otherwise start at lr 0


def tokens_per_sec(size: str, variant: str, steps: int) -> float:
    """One run's median tokens/s over the steps after the first (which pays for warm-up)."""
    if VARIANTS[variant] is None:
        return run_hf_trainer(model_flags(size), SEQ_LEN, GLOBAL_BATCH, steps)["tokens_per_sec"]
    records = run_cli([*model_flags(size), f"--config.data.seq_len={SEQ_LEN}", f"--config.train.batch_size={GLOBAL_BATCH}",
                       f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
                       "--config.train.eval_max_batches=1", "--config.train.save_every=0", *VARIANTS[variant]], nproc=2)
    return statistics.median([r["tokens_per_sec"] for r in records if "loss" in r][1:])


def throughput(size: str, rounds: int, steps: int) -> dict:
    runs = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    for index in range(rounds):
        for name in order[index % len(order):] + order[:index % len(order)]:  # rotate who goes first
            runs[name].append(tokens_per_sec(size, name, steps))
            print(f"{size} {name}: {runs[name][-1]:,.0f} tokens/s", flush=True)
    hf = runs["HF Trainer fsdp2"]
    return {"tokens_per_sec": runs, "median_tokens_per_sec": {k: statistics.median(v) for k, v in runs.items()},
            "vs_hf": {name: statistics.median(a / b for a, b in zip(runs[name], hf))
                      for name in VARIANTS if VARIANTS[name] is not None}}


def executed(size: str) -> dict:
    """FLOPs per token of one step, without and with expert parallelism, against 6 × active parameters."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from portable_fsdp.backends.hf_torch import experts
    from portable_fsdp.backends.hf_torch.model import create_model, describe_model
    from portable_fsdp.backends.torch import executed_flops, expert_parallel
    from portable_fsdp.training import metrics

    config = config_from_flags(model_flags(size))
    info = describe_model(config)
    ids = torch.randint(0, config.model.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    active_experts = info.n_routed_expert_params * info.experts_per_token / info.num_experts
    result = {"n_params": info.n_params, "n_active_params": info.n_active_params}
    for name in ("fsdp2", "ep"):
        model = create_model(config, 0, rank0_only=False)
        if name == "ep":
            expert_parallel.apply_expert_parallel(model, init_device_mesh("cpu", (1,)))
        else:
            experts.set_implementation(model, experts.choose("cpu"))
        counted = executed_flops.per_token(model, ids, ids)
        result[name] = {**counted, "experts_vs_6_active": counted["experts"] / (6 * active_experts),
                        "model_vs_6_active": counted["model"] / (6 * info.n_active_params),
                        "model_vs_mfu_formula": counted["model"] / metrics.flops_per_token(info, SEQ_LEN)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smoke model, 3 steps, one round: measures nothing")
    args = parse_benchmark_args(parser)
    import torch.distributed as dist

    # the one-rank ep group executed() counts ours over; an in-memory store sets nothing the runs it starts inherit
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sizes = ["smoke"] if args.quick else list(MODELS)
    results = {}
    for size in sizes:
        rounds, steps = (1, 3) if args.quick else ROUNDS[size]
        results[size] = {**executed(size), **throughput(size, rounds, steps)}
    dist.destroy_process_group()
    rows = [[f"{size} ({r['n_params'] / 1e6:.1f}M, {r['n_active_params'] / 1e6:.1f}M active)",
             *(f"{r['median_tokens_per_sec'][name]:,.0f}" for name in VARIANTS),
             f"{r['vs_hf']['ours fsdp2']:.2f}", f"{r['vs_hf']['ours ep2']:.2f}",
             f"{r['fsdp2']['experts_vs_6_active']:.3f} / {r['ep']['experts_vs_6_active']:.3f}",
             f"{r['ep']['model_vs_6_active']:.3f}", f"{r['ep']['model_vs_mfu_formula']:.3f}"]
            for size, r in results.items()]
    print(table(["Qwen3-MoE", *(f"{name} tokens/s" for name in VARIANTS), "fsdp2 / Trainer", "ep2 / Trainer",
                 "experts executed / 6·active (fsdp2 / ep)", "step executed / 6·active",
                 "step executed / MFU's 6·active + attention"], rows))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "moe.json",
                   {"machine": machine(), "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH, "models": MODELS,
                    "results": results})


if __name__ == "__main__":
    main()
