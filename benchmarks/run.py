"""The benchmark suite: portable_fsdp against Hugging Face Trainer and against the machine's limit, on CPU.

    python -m benchmarks.run                       # every section (~25 min on 2 cores)
    python -m benchmarks.run --only memory,communication
    python -m benchmarks.run --quick               # tiny models, a few seconds per run: checks the suite works

Sections (each a set of fresh runs of `python -m portable_fsdp.run`, or of a torchrun worker):
  throughput     tokens/s of ours (2 ranks, FSDP2) vs HF Trainer (2 ranks, FSDP2 through Accelerate) vs ours on
                 1 process, same model / data / global batch / steps, runs alternated so drift cancels; MFU; the
                 byte vocabulary's models and the 20M one with 32k and 128k vocabularies (real tokenizers')
  memory         bytes of parameters + gradients + optimizer state per rank vs unsharded / world size, and peak
                 resident memory per rank, world size 1 / 2 / 4 x reshard on/off, CPU offload, checkpointing
  scaling        step time and memory as the model grows, and as the sequence grows with cp=1 vs cp=2
  communication  bytes all-gathered and reduce-scattered per step vs 3·P·(N-1)/N; gloo collectives timed
  overhead       metrics, logging and the progress bar on vs off

Results: benchmarks/results/suite.json (merged by section, so `--only` refreshes part of it), a markdown
report (benchmarks/results/suite.md) and a plot (benchmarks/results/suite.png); `--quick` writes to the temp dir.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import parse_benchmark_args, ROOT, config_from_flags, machine, run_cli, table, torchrun, write_json
from benchmarks.hf_trainer import run_hf_trainer

RESULTS = ROOT / "benchmarks" / "results"
# A quick run proves the suite works; its numbers mean nothing, so they stay out of the repository.
QUICK_RESULTS = pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_suite_quick"
# (hidden, intermediate, layers, heads, kv heads); the byte tokenizer's 384-token vocabulary.
MODELS = {"20M": (512, 1408, 7, 8, 4), "50M": (640, 1728, 10, 10, 5), "100M": (768, 2048, 16, 12, 6)}
QUICK_MODELS = {"20M": (64, 160, 2, 4, 2), "50M": (96, 256, 2, 4, 2), "100M": (128, 352, 2, 4, 2)}
# The 20M shape with a real tokenizer's vocabulary (Llama 2's, Llama 3's): embedding and lm_head then hold most
# of the parameters and the loss most of the memory. The byte tokenizer's ids are a subset of either.
VOCAB_MODELS = {"20M, vocab 32k": ("20M", 32_000), "20M, vocab 128k": ("20M", 128_256)}
SEQ_LEN, GLOBAL_BATCH = 256, 4
# The throughput section's models: (model, rounds, steps per run).
THROUGHPUT = (("20M", 3, 8), ("100M", 2, 5), ("20M, vocab 32k", 2, 5), ("20M, vocab 128k", 2, 4))
# Same schedule on both sides of every comparison (Trainer's warm-up would otherwise start at lr 0 for 20 steps).
SCHEDULE = ["--config.train.warmup_steps=1"]


class Suite:
    def __init__(self, quick: bool):
        self.quick = quick
        self.models = QUICK_MODELS if quick else MODELS

    def model_flags(self, size: str) -> list:
        if size in VOCAB_MODELS:
            shape, vocab = VOCAB_MODELS[size]
            return [*self.model_flags(shape), f"--config.model.vocab_size={vocab}"]
        hidden, inter, layers, heads, kv = self.models[size]
        return [f"--config.model.hidden_size={hidden}", f"--config.model.intermediate_size={inter}",
                f"--config.model.num_hidden_layers={layers}", f"--config.model.num_attention_heads={heads}",
                f"--config.model.num_key_value_heads={kv}", "--config.model.max_position_embeddings=4096", *SCHEDULE]

    def steps(self, normal: int) -> int:
        return 3 if self.quick else normal

    def n_params(self, size: str) -> int:
        from portable_fsdp.backends.hf_torch.model import describe_model

        return describe_model(config_from_flags(self.model_flags(size))).n_params

    def ours(self, size: str, nproc: int, steps: int, *extra: str, seq_len: int = SEQ_LEN,
             batch: int = GLOBAL_BATCH, env: dict | None = None) -> dict:
        """One run of our CLI; medians over the steps after the first (which pays for warm-up)."""
        records = run_cli([*self.model_flags(size), f"--config.data.seq_len={seq_len}", f"--config.train.batch_size={batch}",
                           f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
                           "--config.train.eval_max_batches=1", *extra], nproc=nproc, env=env)
        train = [r for r in records if "loss" in r]
        end = next(r for r in records if r.get("event") == "end")
        last = train[-1]
        return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train[1:]),
                "mfu": statistics.median(r["mfu"] for r in train[1:]),
                "step_seconds": batch * seq_len / statistics.median(r["tokens_per_sec"] for r in train[1:]),
                "peak_mb": last["peak_mem_mb"], "base_mb": last["base_mem_mb"],
                "state_mb": [s + g for s, g in zip(last["state_mb"], last["grad_mb"])], "shm_mb": last["shm_mb"],
                "bookkeeping_fraction": end["bookkeeping_fraction"], "final_loss": last["loss"]}

    # ---- sections -------------------------------------------------------------------------------------
    def throughput(self) -> dict:
        out = {}
        for size, reps, steps in THROUGHPUT:
            runs = {"ours_ws2": [], "hf_ws2": [], "ours_ws2_gloo": [], "ours_ws1": []}
            order = list(runs)
            for rep in range(1 if self.quick else reps):
                for name in order[rep % 4:] + order[:rep % 4]:  # rotate who goes first
                    if name == "hf_ws2":
                        hf = run_hf_trainer(self.model_flags(size), SEQ_LEN, GLOBAL_BATCH, self.steps(steps))
                        runs[name].append({"tokens_per_sec": hf["tokens_per_sec"], "final_loss": hf["final_loss"]})
                    elif name == "ours_ws2_gloo":  # ours without the shared-memory collectives: where the gain is
                        runs[name].append(self.ours(size, 2, self.steps(steps), "--config.plan.cpu_collectives=gloo"))
                    else:
                        runs[name].append(self.ours(size, 2 if name == "ours_ws2" else 1, self.steps(steps)))
                    print(f"throughput {size} {name}: {runs[name][-1]['tokens_per_sec']:,.0f} tokens/s", flush=True)
            tps = {k: [r["tokens_per_sec"] for r in v] for k, v in runs.items()}
            mfu_per_token = statistics.median(r["mfu"] / r["tokens_per_sec"] for r in runs["ours_ws2"])
            out[size] = {"n_params": self.n_params(size), "steps": self.steps(steps), "runs": runs,
                         "median_tokens_per_sec": {k: statistics.median(v) for k, v in tps.items()},
                         "ratio_vs_hf": statistics.median(a / b for a, b in zip(tps["ours_ws2"], tps["hf_ws2"])),
                         "ratio_gloo_vs_hf": statistics.median(a / b for a, b in zip(tps["ours_ws2_gloo"], tps["hf_ws2"])),
                         "ratio_ws2_vs_ws1": statistics.median(a / b for a, b in zip(tps["ours_ws2"], tps["ours_ws1"])),
                         # HF's MFU against the same measured GEMM peak of 2 one-thread processes
                         "mfu": {"ours_ws2": statistics.median(r["mfu"] for r in runs["ours_ws2"]),
                                 "hf_ws2": mfu_per_token * statistics.median(tps["hf_ws2"]),
                                 "ours_ws1": statistics.median(r["mfu"] for r in runs["ours_ws1"])}}
        return out

    def memory(self) -> dict:
        options = {"reshard on": [], "reshard off": ["--config.plan.reshard_after_forward=false"],
                   "cpu offload (no-op on a CPU run)": ["--config.plan.cpu_offload=true"],
                   "activation checkpointing": ["--config.plan.activation_checkpointing=true"]}
        # the cpu backend keeps freed blocks for the next step (portable_fsdp/backends/torch/host_allocator.py); a fixed mmap
        # threshold, which a user may set instead, returns large blocks at once, for page faults on every new one
        unmapped = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
        rows = []
        for world in (1, 2, 4):
            for option, flags in [*options.items(), ("reshard on, MALLOC_MMAP_THRESHOLD_=4 MB", [])]:
                if (world == 1 and option == "reshard off") or (world == 4 and option.startswith("reshard on, ")):
                    continue  # one rank: nothing to reshard; the allocator's effect is seen at 1 and 2 ranks
                env = unmapped if "MALLOC" in option else None
                result = self.ours("100M", world, self.steps(3), *flags, env=env)
                rows.append({"world_size": world, "option": option, **result})
                print(f"memory ws{world} {option}: peak {max(result['peak_mb']):.0f} MB/rank", flush=True)
        full_state = next(r for r in rows if r["world_size"] == 1 and r["option"] == "reshard on")["state_mb"][0]
        for row in rows:
            row["ideal_state_mb"] = full_state / row["world_size"]
            row["state_vs_ideal"] = max(row["state_mb"]) / row["ideal_state_mb"]
        return {"model": "100M", "n_params": self.n_params("100M"), "rows": rows}

    def scaling(self) -> dict:
        sizes = []
        for size in self.models:
            result = self.ours(size, 2, self.steps(4))
            sizes.append({"model": size, "n_params": self.n_params(size), **result})
            print(f"scaling {size}: {result['step_seconds']:.2f} s/step", flush=True)
        lengths = []
        for seq_len in ((128, 256) if self.quick else (512, 1024, 2048)):
            for cp in (1, 2):
                result = self.ours("20M", 2, self.steps(3), f"--config.plan.cp_size={cp}", seq_len=seq_len, batch=2)
                lengths.append({"seq_len": seq_len, "cp_size": cp, **result})
                print(f"scaling L={seq_len} cp={cp}: {result['step_seconds']:.2f} s/step", flush=True)
        return {"sizes": sizes, "lengths": lengths}

    def communication(self) -> dict:
        rows = []
        for world in (2, 4):
            for reshard in (True, False):
                with tempfile.TemporaryDirectory() as tmp:
                    out = f"{tmp}/comm.json"
                    torchrun(world, ["benchmarks.comm_worker", out, "steps", *self.model_flags("20M"),
                                     f"--config.data.seq_len={SEQ_LEN}", f"--config.train.batch_size={GLOBAL_BATCH}",
                                     f"--config.plan.reshard_after_forward={str(reshard).lower()}"], timeout=900)
                    result = json.loads(open(out).read())
                # 3·P·(N-1)/N: all-gather in forward and again in backward, one reduce-scatter; FSDP2 keeps the
                # root's parameters gathered from forward to backward, so those are gathered once
                fraction = (world - 1) / world
                result.update(reshard_after_forward=reshard, theory_bytes=(3 if reshard else 2) * result["param_bytes"] * fraction,
                              expected_bytes=((3 if reshard else 2) * result["param_bytes"]
                                              - (result["root_param_bytes"] if reshard else 0)) * fraction)
                rows.append(result)
                print(f"communication ws{world} reshard={reshard}: {result['sent_per_step']}", flush=True)
        timings = []
        for world in (2, 4):
            with tempfile.TemporaryDirectory() as tmp:
                numel = 3 * 512 * 1408 + 2 * 512 * 512 + 2 * 512 * 256  # one layer of the 20M model
                torchrun(world, ["benchmarks.comm_worker", f"{tmp}/t.json", "collectives", str(numel)], timeout=600)
                timings.append(json.loads(open(f"{tmp}/t.json").read()))
        return {"model": "20M", "rows": rows, "collective_timings": timings}

    def overhead(self) -> dict:
        settings = {"on": ["--config.train.log_every=1", "--config.train.progress_bar=true"],
                    "off": ["--config.train.log_every=100000", "--config.train.progress_bar=false"]}
        runs = {name: [] for name in settings}
        for rep in range(1 if self.quick else 2):
            for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                records = run_cli([*self.model_flags("20M"), f"--config.data.seq_len={SEQ_LEN}",
                                   f"--config.train.batch_size={GLOBAL_BATCH}", f"--config.train.steps={self.steps(12)}",
                                   "--config.train.eval_every=0", "--config.train.eval_max_batches=1",
                                   *settings[name]], nproc=2)
                end = next(r for r in records if r.get("event") == "end")
                runs[name].append({"bookkeeping_fraction": end["bookkeeping_fraction"],
                                   "step_seconds_median": end["step_seconds_median"]})
        return {name: {"bookkeeping_fraction": statistics.median(r["bookkeeping_fraction"] for r in v),
                       "step_seconds_median": statistics.median(r["step_seconds_median"] for r in v)}
                for name, v in runs.items()}


SECTIONS = ["throughput", "memory", "scaling", "communication", "overhead"]


def report(results: dict) -> str:
    """Markdown tables of whatever sections `results` holds."""
    parts = []
    if "throughput" in results:
        rows = []
        for size, r in results["throughput"].items():
            t, m = r["median_tokens_per_sec"], r["mfu"]
            rows.append([f"{size} ({r['n_params'] / 1e6:.1f}M)", f"{t['ours_ws2']:,.0f}", f"{t['hf_ws2']:,.0f}",
                         f"{r['ratio_vs_hf']:.2f}x", f"{t['ours_ws2_gloo']:,.0f} ({r['ratio_gloo_vs_hf']:.2f}x)",
                         f"{t['ours_ws1']:,.0f}", f"{r['ratio_ws2_vs_ws1']:.2f}",
                         f"{100 * m['ours_ws2']:.1f}% / {100 * m['hf_ws2']:.1f}% / {100 * m['ours_ws1']:.1f}%"])
        parts.append("### Throughput (tokens/s, median step; ratios = median of same-round ratios)\n\n" + table(
            ["model", "ours, 2 ranks", "HF Trainer, 2 ranks", "ours / HF", "ours, gloo collectives (/ HF)",
             "ours, 1 process", "2 ranks / 1 process", "MFU ours 2r / HF 2r / ours 1p"], rows))
    if "memory" in results:
        rows = [[r["world_size"], r["option"], f"{max(r['state_mb']):.1f}", f"{r['ideal_state_mb']:.1f}",
                 f"{100 * (r['state_vs_ideal'] - 1):+.2f}%", f"{max(r['peak_mb']):.0f}",
                 f"{max(r['shm_mb']):.0f}", f"{max(p - b for p, b in zip(r['peak_mb'], r['base_mb'])):.0f}",
                 f"{r['tokens_per_sec']:,.0f}"] for r in results["memory"]["rows"]]
        parts.append(f"### Memory per rank, {results['memory']['model']} model "
                     f"({results['memory']['n_params'] / 1e6:.1f}M parameters)\n\n" + table(
            ["world", "option", "params+grads+Adam MB", "ideal MB", "vs ideal", "peak RSS MB", "of which shared MB",
             "peak above libraries MB", "tokens/s"], rows))
    if "scaling" in results:
        s = results["scaling"]
        parts.append("### Scaling with model size (2 ranks, reshard on)\n\n" + table(
            ["model", "parameters", "step s", "tokens/s", "MFU", "peak RSS MB/rank"],
            [[r["model"], f"{r['n_params'] / 1e6:.1f}M", f"{r['step_seconds']:.2f}", f"{r['tokens_per_sec']:,.0f}",
              f"{100 * r['mfu']:.1f}%", f"{max(r['peak_mb']):.0f}"] for r in s["sizes"]]))
        parts.append("### Scaling with sequence length (20M model, 2 ranks, 2 sequences per step)\n\n" + table(
            ["seq_len", "cp_size", "step s", "tokens/s", "peak RSS MB/rank", "peak above libraries MB"],
            [[r["seq_len"], r["cp_size"], f"{r['step_seconds']:.2f}", f"{r['tokens_per_sec']:,.0f}",
              f"{max(r['peak_mb']):.0f}", f"{max(p - b for p, b in zip(r['peak_mb'], r['base_mb'])):.0f}"]
             for r in s["lengths"]]))
    if "communication" in results:
        c = results["communication"]
        rows = [[r["world_size"], "on" if r["reshard_after_forward"] else "off", f"{r['param_bytes'] / 2**20:.1f}",
                 f"{r['sent_per_step']['all_gather'] / 2**20:.1f}", f"{r['sent_per_step']['reduce_scatter'] / 2**20:.1f}",
                 f"{(r['sent_per_step']['all_gather'] + r['sent_per_step']['reduce_scatter']) / 2**20:.1f}",
                 f"{r['theory_bytes'] / 2**20:.1f}", f"{r['expected_bytes'] / 2**20:.1f}",
                 f"{r['sent_per_step']['all_reduce']:.0f} B"] for r in c["rows"]]
        parts.append(f"### Communication per rank per step ({c['model']} model; MiB a bandwidth-optimal collective "
                     "sends for what FSDP2 asks)\n\n" + table(
            ["world", "reshard", "P (MiB)", "all-gather", "reduce-scatter", "total", "k·P·(N-1)/N",
             "minus the root's 2nd gather", "other (scalars)"], rows))
        names = list(c["collective_timings"][0]["median_ms"])
        parts.append("### Collectives, gloo's and ours, one layer of the 20M model "
                     f"({c['collective_timings'][0]['megabytes']:.1f} MB), median ms\n\n" + table(
            ["world", *names], [[t["world_size"], *(f"{t['median_ms'][n]:.1f}" for n in names)]
                                for t in c["collective_timings"]]))
    if "overhead" in results:
        o = results["overhead"]
        parts.append("### Metrics, logging and progress bar (20M model, 2 ranks)\n\n" + table(
            ["setting", "bookkeeping / step time", "median step s"],
            [["log every step + progress bar", f"{100 * o['on']['bookkeeping_fraction']:.3f}%",
              f"{o['on']['step_seconds_median']:.3f}"],
             ["log at the end only, no bar", f"{100 * o['off']['bookkeeping_fraction']:.3f}%",
              f"{o['off']['step_seconds_median']:.3f}"]]))
    return "\n\n".join(parts) + "\n"


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    if "throughput" in results:
        ax, t = axes[0][0], results["throughput"]
        names = [("ours_ws2", "ours, 2 ranks"), ("hf_ws2", "HF Trainer, 2 ranks"),
                 ("ours_ws2_gloo", "ours, 2 ranks, gloo collectives"), ("ours_ws1", "ours, 1 process")]
        for i, (key, label) in enumerate(names):
            ax.bar([j + 0.2 * i for j in range(len(t))],
                   [r["median_tokens_per_sec"][key] / r["median_tokens_per_sec"]["ours_ws1"] for r in t.values()],
                   width=0.2, label=label)
        ax.set_xticks([j + 0.3 for j in range(len(t))], list(t))
        ax.set_ylabel("tokens/s relative to ours, 1 process")
        ax.set_title("Throughput (FSDP2, fp32, seq 256, batch 4)")
        ax.set_ylim(0, 1.3)
        ax.legend(loc="upper center", ncol=2, fontsize=8)
    if "memory" in results:
        ax, rows = axes[0][1], results["memory"]["rows"]
        short = {"reshard on": "reshard on", "reshard off": "reshard off", "activation checkpointing": "act. ckpt"}
        labels = [f"ws{r['world_size']} " + short.get(r["option"], "cpu offload" if "offload" in r["option"] else
                                                       "malloc 4 MB") for r in rows]
        base = [max(r["base_mb"]) for r in rows]
        above = [max(p - b for p, b in zip(r["peak_mb"], r["base_mb"])) for r in rows]
        ax.bar(labels, base, label="libraries (before the model)", color="lightgray")
        ax.bar(labels, above, bottom=base, label="model, optimizer, activations")
        one_rank = max(next(r for r in rows if r["world_size"] == 1 and r["option"] == "reshard on")["peak_mb"])
        ax.axhline(0.6 * one_rank, color="k", linestyle="--", linewidth=1, label="target at 2 ranks: 0.6 × 1 rank")
        ax.set_ylabel("peak resident MB per rank")
        ax.set_title(f"Memory per rank ({results['memory']['model']} model)")
        ax.tick_params(axis="x", labelsize=7, labelrotation=60)
        ax.legend()
    if "scaling" in results:
        ax, s = axes[1][0], results["scaling"]
        ax.plot([r["n_params"] / 1e6 for r in s["sizes"]], [r["step_seconds"] for r in s["sizes"]], "o-",
                label="model size (seq 256)")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("step seconds")
        twin = ax.twiny()
        for cp in (1, 2):
            points = [r for r in s["lengths"] if r["cp_size"] == cp]
            twin.plot([r["seq_len"] for r in points], [r["step_seconds"] for r in points], "s--",
                      color="C1" if cp == 1 else "C2", label=f"sequence length, cp={cp} (20M)")
        twin.set_xlabel("sequence length")
        ax.legend(loc="upper left")
        twin.legend(loc="lower right")
        ax.set_title("Scaling (2 ranks)", pad=30)
    if "communication" in results:
        ax, rows = axes[1][1], results["communication"]["rows"]
        labels = [f"ws{r['world_size']} reshard {'on' if r['reshard_after_forward'] else 'off'}" for r in rows]
        ax.bar(labels, [r["sent_per_step"]["all_gather"] / 2**20 for r in rows], label="all-gather")
        ax.bar(labels, [r["sent_per_step"]["reduce_scatter"] / 2**20 for r in rows],
               bottom=[r["sent_per_step"]["all_gather"] / 2**20 for r in rows], label="reduce-scatter")
        ax.plot(labels, [r["theory_bytes"] / 2**20 for r in rows], "k_", markersize=40, mew=2, label="k·P·(N-1)/N")
        ax.plot(labels, [r["expected_bytes"] / 2**20 for r in rows], "r_", markersize=40, mew=2,
                label="minus the root's second gather")
        ax.set_ylabel("MiB sent per rank per step")
        ax.set_title("Communication (20M model)")
        ax.set_ylim(0, 1.45 * max(r["theory_bytes"] / 2**20 for r in rows))  # room for the legend
        ax.legend(loc="upper left", ncol=2, fontsize=8, markerscale=0.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="tiny models and steps: check the suite, measure nothing")
    args = parse_benchmark_args(parser)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {SECTIONS}" if unknown else
                     f"--only: no section given; choose from {SECTIONS}")
    out = QUICK_RESULTS if args.quick else RESULTS / "suite"
    results = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    suite = Suite(args.quick)
    for section in chosen:
        try:
            results[section] = getattr(suite, section)()
        except (RuntimeError, subprocess.TimeoutExpired) as err:  # a run failed: say which, keep what is done
            sys.exit(f"error: benchmark section {section!r} failed: {err}")
        results["machine"] = machine()
        write_json(out.with_suffix(".json"), results)  # after every section: a late failure keeps the rest
    text = report(results)
    out.with_suffix(".md").write_text(text)
    plot(results, out.with_suffix(".png"))
    print()
    print(text)


if __name__ == "__main__":
    main()
