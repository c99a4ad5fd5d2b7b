"""portable_fsdp side by side with the trainers users would pick instead: torchtitan (torch-native FSDP2) and
MaxText (JAX), and Hugging Face Trainer, on the same Llama shapes, corpus, byte tokenizer, AdamW settings,
schedule and global batch, on CPU.

    python -m benchmarks.peers --torchtitan-python TT/bin/python --maxtext-python MT/bin/python
    python -m benchmarks.peers --quick          # a tiny shape, 6 steps: checks the benchmark works

Pairs, each measured in alternating order round after round (which side runs first flips every round, so the
machine's drift cancels), tokens/s of the whole job (global batch x sequence / median step time, the first two
steps left out):
  ours vs torchtitan, 2 ranks and 1 rank   both on torchtitan's venv (the SAME torch; our package runs from this
                                           repository with that interpreter), `--backend cpu`; at 2 ranks also
                                           ours with gloo's collectives, as torchtitan's (plan.cpu_collectives=gloo)
  ours vs HF Trainer, 2 ranks              both on this interpreter's torch (Trainer + Accelerate FSDP2)
  ours (flax) vs MaxText, 2 host devices   `--backend flax` here, MaxText on its own Python 3.12 venv
A peer whose interpreter is not given (flag or PORTABLE_FSDP_TORCHTITAN_PYTHON / PORTABLE_FSDP_MAXTEXT_PYTHON) is
skipped with one line. Each run's per-step losses are kept: the curves cannot be equal (different initialisation,
data order, RoPE layout, attention over documents) but must fall alike; the report says how far apart they end.

Results: benchmarks/results/peers.json (`--quick`: the temp dir) and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile

from benchmarks.common import (ROOT, attempt, error_line, free_port, machine, parse_benchmark_args, run_cli, run_python,
                               table, write_json)
from benchmarks.hf_trainer import run_hf_trainer

RESULTS = ROOT / "benchmarks" / "results" / "peers.json"
VOCAB, GLOBAL_BATCH, LR, WARMUP, MIN_LR_RATIO, MAX_NORM, ROPE_THETA = 384, 8, 3e-3, 5, 0.1, 1.0, 10000.0
SKIPPED_STEPS = 2  # compilation, allocator and thread-pool warm-up
SEED = 0  # ours' default seed (--config.seed), given to torchtitan too (which otherwise draws a new one every run)


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int

    def ours(self) -> list:
        return [f"--config.model.vocab_size={VOCAB}", f"--config.model.hidden_size={self.hidden}",
                f"--config.model.intermediate_size={self.intermediate}",
                f"--config.model.num_hidden_layers={self.layers}",
                f"--config.model.num_attention_heads={self.heads}",
                f"--config.model.num_key_value_heads={self.kv_heads}", f"--config.model.rope_theta={ROPE_THETA}"]


# A small shape where each framework's per-step overhead shows, and a ~25M one where compute dominates.
SHAPES = {"3.3M": Shape(256, 768, 4, 4, 2, 256), "25M": Shape(512, 1376, 8, 8, 4, 512)}
QUICK_SHAPES = {"tiny": Shape(64, 160, 2, 4, 2, 64)}


def corpus_and_tokenizer(folder: pathlib.Path) -> pathlib.Path:
    """Our bundled corpus as JSON lines and our byte tokenizer in transformers' format, where torchtitan's config
    and MaxText's Hugging Face pipeline read them (tests/assets/{c4_test,tokenizer} under `folder`)."""
    from portable_fsdp.data.sources import iter_bundled
    from portable_fsdp.data.tokenizers import byte_tokenizer_for_transformers

    data = folder / "tests" / "assets" / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.jsonl", "w") as out:
        for doc in iter_bundled():
            if doc.strip():
                out.write(json.dumps({"text": doc}) + "\n")
    byte_tokenizer_for_transformers().save_pretrained(str(folder / "tests" / "assets" / "tokenizer"))
    return folder


def _schedule(steps: int) -> list:
    return [f"--config.train.steps={steps}", f"--config.train.lr={LR}", f"--config.train.warmup_steps={WARMUP}",
            f"--config.train.min_lr_ratio={MIN_LR_RATIO}", f"--config.train.max_grad_norm={MAX_NORM}",
            f"--config.train.batch_size={GLOBAL_BATCH}", "--config.train.log_every=1", "--config.train.eval_every=0",
            "--config.train.eval_max_batches=1", f"--config.seed={SEED}"]


def run_ours(shape: Shape, steps: int, nproc: int, backend: str = "cpu", python: str | None = None,
             flags: tuple = ()) -> dict:
    records = run_cli([f"--backend={backend}", *shape.ours(), f"--config.data.seq_len={shape.seq_len}",
                       *_schedule(steps), *flags], nproc=nproc, python=python)
    train = [r for r in records if "tokens_per_sec" in r]
    # With log_every=1 each record is one step: its tokens/s is the global batch over that step's time.
    step_seconds = [GLOBAL_BATCH * shape.seq_len / r["tokens_per_sec"] for r in train]
    return _result(step_seconds, [r["loss"] for r in train], shape)


def _result(step_seconds: list, losses: list, shape: Shape) -> dict:
    median = statistics.median(step_seconds[SKIPPED_STEPS:] or step_seconds)
    return {"tokens_per_sec": GLOBAL_BATCH * shape.seq_len / median, "step_seconds": step_seconds, "losses": losses}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+).*?tps:\s*([\d,]+)")


def parse_torchtitan(log: str, nproc: int, shape: Shape) -> dict:
    """torchtitan's `step: N loss: L ... tps: T` lines (every rank logs; the first of each step is kept). tps is
    one rank's tokens/s (local batch x seq / step time), so the step time is the global batch's tokens / (T x nproc)."""
    steps = {}
    for step, loss, tps in _TITAN_STEP.findall(_ANSI.sub("", log)):
        steps.setdefault(int(step), (float(loss), float(tps.replace(",", ""))))
    if not steps:
        raise RuntimeError("torchtitan printed no step lines")
    ordered = [steps[k] for k in sorted(steps)]
    return _result([GLOBAL_BATCH * shape.seq_len / (tps * nproc) for _, tps in ordered],
                   [loss for loss, _ in ordered], shape)


def run_torchtitan(python: str, inputs: pathlib.Path, shape: Shape, steps: int, nproc: int) -> dict:
    env = {"PYTHONPATH": str(ROOT / "benchmarks" / "peer_torchtitan"),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
           "PEER_HIDDEN": str(shape.hidden), "PEER_LAYERS": str(shape.layers), "PEER_HEADS": str(shape.heads),
           "PEER_KV_HEADS": str(shape.kv_heads), "PEER_INTER": str(shape.intermediate), "PEER_VOCAB": str(VOCAB),
           "PEER_SEQ": str(shape.seq_len), "PEER_BATCH": str(GLOBAL_BATCH), "PEER_STEPS": str(steps),
           "PEER_LR": str(LR), "PEER_WARMUP": str(WARMUP), "PEER_MIN_LR_RATIO": str(MIN_LR_RATIO),
           "PEER_MAX_NORM": str(MAX_NORM), "PEER_ROPE_THETA": str(ROPE_THETA), "PEER_SEED": str(SEED)}
    with tempfile.TemporaryDirectory(prefix="torchtitan-") as out:
        proc = run_python(["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                           str(free_port()), "--log-dir", out + "/agent",
                           str(ROOT / "benchmarks" / "peer_torchtitan" / "cpu_launch.py"), "--module", "llama_config",
                           "--config", "llama_peer", "--dump_folder", out + "/dump"],
                          timeout=3600, env=env, python=python, cwd=inputs)
    if proc.returncode != 0:
        raise RuntimeError(f"torchtitan failed: {error_line(proc.stderr)}")
    return parse_torchtitan(proc.stdout + proc.stderr, nproc, shape)


_MAXTEXT_STEP = re.compile(r"completed step:\s*(\d+),\s*seconds:\s*([\d.]+),.*?loss:\s*([-\d.]+)")


def parse_maxtext(log: str, shape: Shape) -> dict:
    """MaxText's `completed step: N, seconds: S, ..., loss: L` lines (one process drives every device)."""
    steps = {int(n): (float(s), float(loss)) for n, s, loss in _MAXTEXT_STEP.findall(log)}
    if not steps:
        raise RuntimeError("MaxText printed no step lines")
    ordered = [steps[k] for k in sorted(steps)]
    return _result([s for s, _ in ordered], [loss for _, loss in ordered], shape)


def run_maxtext(python: str, inputs: pathlib.Path, shape: Shape, steps: int, devices: int) -> dict:
    """MaxText's pre-training entry point on `devices` host devices; its packing keeps attention within documents
    (ours with data.document_masking=true would match; the default run packs across documents)."""
    config = pathlib.Path(run_python(["-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"], 120,
                                     python=python).stdout.strip()) / "configs" / "base.yml"
    with tempfile.TemporaryDirectory(prefix="maxtext-") as out:
        args = ["-m", "maxtext.trainers.pre_train.train", str(config), "run_name=peer", f"base_output_directory={out}",
                "hardware=cpu", "skip_jax_distributed_system=true", "enable_checkpointing=false", "dataset_type=hf",
                "hf_path=json", f"hf_train_files={inputs}/tests/assets/c4_test/train.jsonl",
                "tokenizer_type=huggingface", f"tokenizer_path={inputs}/tests/assets/tokenizer", "add_bos=false",
                "add_eos=true", f"steps={steps}", f"per_device_batch_size={GLOBAL_BATCH // devices}",
                f"max_target_length={shape.seq_len}", f"base_emb_dim={shape.hidden}",
                f"base_num_query_heads={shape.heads}", f"base_num_kv_heads={shape.kv_heads}",
                f"head_dim={shape.hidden // shape.heads}", f"base_mlp_dim={shape.intermediate}",
                f"base_num_decoder_layers={shape.layers}", f"vocab_size={VOCAB}", "decoder_block=llama2",
                "dtype=float32", "weight_dtype=float32", "attention=dot_product", f"learning_rate={LR}",
                f"warmup_steps_fraction={WARMUP / steps}", f"learning_rate_final_fraction={MIN_LR_RATIO}",
                "adam_b1=0.9", "adam_b2=0.95", "adam_eps=1e-8", "adam_weight_decay=0.1",
                f"gradient_clipping_threshold={MAX_NORM}", f"rope_max_timescale={int(ROPE_THETA)}",
                "ici_fsdp_parallelism=-1", "log_period=1", "enable_tensorboard=false",
                "enable_goodput_recording=false", "monitor_goodput=false"]
        env = {"DECOUPLE_GCLOUD": "TRUE", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
               "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = run_python(args, timeout=3600, env=env, python=python, cwd=inputs)
    if proc.returncode != 0:
        raise RuntimeError(f"MaxText failed: {error_line(proc.stderr)}")
    return parse_maxtext(proc.stdout + proc.stderr, shape)


def run_trainer(shape: Shape, steps: int) -> dict:
    flags = [*shape.ours(), f"--config.seed={SEED}", f"--config.train.lr={LR}", f"--config.train.warmup_steps={WARMUP}",
             f"--config.train.min_lr_ratio={MIN_LR_RATIO}", f"--config.train.max_grad_norm={MAX_NORM}"]
    result = run_hf_trainer(flags, shape.seq_len, GLOBAL_BATCH, steps, nproc=2)
    return _result(result["step_seconds"], result["losses"], shape)


@dataclasses.dataclass(frozen=True)
class Pair:
    """Ours against one peer at one rank count: two callables (shape, steps) -> result."""
    name: str
    peer: str
    ranks: int
    ours: object
    theirs: object


def pairs(torchtitan: str | None, maxtext: str | None, inputs: pathlib.Path) -> tuple[list, list]:
    """The pairs this machine can run, and one line per peer that is skipped."""
    found, skipped = [], []
    if torchtitan:
        for ranks in (2, 1):
            found.append(Pair(f"ours / torchtitan, {ranks} rank{'s' * (ranks > 1)}", "torchtitan 0.3.0", ranks,
                              lambda shape, steps, r=ranks: run_ours(shape, steps, r, python=torchtitan),
                              lambda shape, steps, r=ranks: run_torchtitan(torchtitan, inputs, shape, steps, r)))
        # the same collectives as torchtitan's (gloo over TCP): what our shared-memory ones are worth
        found.append(Pair("ours with gloo's collectives / torchtitan, 2 ranks", "torchtitan 0.3.0", 2,
                          lambda shape, steps: run_ours(shape, steps, 2, python=torchtitan,
                                                        flags=("--config.plan.cpu_collectives=gloo",)),
                          lambda shape, steps: run_torchtitan(torchtitan, inputs, shape, steps, 2)))
    else:
        skipped.append("torchtitan skipped: no interpreter given (--torchtitan-python or "
                       "PORTABLE_FSDP_TORCHTITAN_PYTHON: a venv with torchtitan==0.3.0 and this package's dependencies)")
    found.append(Pair("ours / HF Trainer, 2 ranks", "HF Trainer (FSDP2)", 2,
                      lambda shape, steps: run_ours(shape, steps, 2), run_trainer))
    if maxtext:
        found.append(Pair("ours (flax) / MaxText, 2 devices", "MaxText 0.2.5", 2,
                          lambda shape, steps: run_ours(shape, steps, 2, backend="flax"),
                          lambda shape, steps: run_maxtext(maxtext, inputs, shape, steps, 2)))
    else:
        skipped.append("MaxText skipped: no interpreter given (--maxtext-python or PORTABLE_FSDP_MAXTEXT_PYTHON: "
                       "a Python 3.12 venv with maxtext==0.2.5 and its CPU requirements)")
    return found, skipped


def measure(found: list, shapes: dict, rounds: int, steps: int, report=print) -> list:
    """Every pair on every shape, `rounds` times, the side that runs first alternating; a row per round. A run that
    fails is that row's one-line error (its ratio None); the other runs go on."""
    rows = []
    for index in range(rounds):
        for label, shape in shapes.items():
            for pair in found:
                sides = [("ours", pair.ours), ("peer", pair.theirs)]
                results = {side: attempt(run, shape, steps)
                           for side, run in (sides if index % 2 == 0 else sides[::-1])}
                failed = [f"{side} failed: {result['error']}" for side, result in results.items() if "error" in result]
                ratio = None if failed else results["ours"]["tokens_per_sec"] / results["peer"]["tokens_per_sec"]
                rows.append({"round": index + 1, "shape": label, "pair": pair.name, "peer": pair.peer,
                             "ranks": pair.ranks, **results, "ratio": ratio})
                outcome = "; ".join(failed) if failed else (
                    f"{results['ours']['tokens_per_sec']:,.0f} vs {results['peer']['tokens_per_sec']:,.0f} tokens/s "
                    f"({ratio:.2f}x)")
                report(f"round {index + 1} {label} {pair.name}: {outcome}")
    return rows


def summary(rows: list) -> list:
    """Per shape and pair: tokens/s of every round on each side ("failed" for a run that did), ratios per round,
    the median of those measured, and how far apart the loss curves of the last measured round end (final losses,
    and the largest gap over the last half of the steps)."""
    def tokens(result: dict) -> str:
        return "failed" if "error" in result else f"{result['tokens_per_sec']:,.0f}"

    table_rows = []
    for key in dict.fromkeys((r["shape"], r["pair"]) for r in rows):
        group = [r for r in rows if (r["shape"], r["pair"]) == key]
        measured = [r for r in group if r["ratio"] is not None]
        ratios = [r["ratio"] for r in measured]
        row = [key[0], key[1], ", ".join(tokens(r["ours"]) for r in group), ", ".join(tokens(r["peer"]) for r in group),
               ", ".join("-" if r["ratio"] is None else f"{r['ratio']:.2f}" for r in group)]
        if not measured:
            table_rows.append([*row, "-", "-", "-"])
            continue
        last = measured[-1]
        gap = loss_gap(last["ours"]["losses"], last["peer"]["losses"])
        table_rows.append([*row, f"{statistics.median(ratios):.2f}x",
                           f"{last['ours']['losses'][-1]:.3f} / {last['peer']['losses'][-1]:.3f}", f"{gap:.3f}"])
    return table_rows


HEADERS = ["shape", "pair", "ours tokens/s", "peer tokens/s", "ratio per round", "median", "final loss ours / peer",
           "largest loss gap, 2nd half"]


def loss_gap(ours: list, theirs: list) -> float:
    steps = min(len(ours), len(theirs))
    return max(abs(a - b) for a, b in zip(ours[steps // 2:steps], theirs[steps // 2:steps]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torchtitan-python", default=os.environ.get("PORTABLE_FSDP_TORCHTITAN_PYTHON"))
    parser.add_argument("--maxtext-python", default=os.environ.get("PORTABLE_FSDP_MAXTEXT_PYTHON"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"a subset of {','.join(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help="tiny shape, 1 round of 6 steps (results to the temp dir)")
    args = parse_benchmark_args(parser, argv)
    for flag in ("torchtitan_python", "maxtext_python"):
        value = getattr(args, flag)
        if value and not pathlib.Path(value).is_file():
            sys.exit(f"--{flag.replace('_', '-')}: {value} is not a file; give a venv's bin/python")
    if args.steps <= WARMUP + SKIPPED_STEPS:
        sys.exit(f"--steps: {args.steps} is too few; give at least {WARMUP + SKIPPED_STEPS + 1} (the warm-up takes "
                 f"{WARMUP} steps and the first {SKIPPED_STEPS} are not timed)")
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown and not args.quick:
        sys.exit(f"--shapes: unknown {','.join(sorted(unknown))}; choose among {','.join(SHAPES)}")
    shapes = QUICK_SHAPES if args.quick else {k: SHAPES[k] for k in args.shapes.split(",")}
    rounds, steps = (1, WARMUP + 1) if args.quick else (args.rounds, args.steps)
    with tempfile.TemporaryDirectory(prefix="peers-") as folder:
        inputs = corpus_and_tokenizer(pathlib.Path(folder))
        found, skipped = pairs(args.torchtitan_python, args.maxtext_python, inputs)
        for line in skipped:
            print(line)
        rows = measure(found, shapes, rounds, steps)
    print(table(HEADERS, summary(rows)))
    out = pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_peers_quick.json" if args.quick else RESULTS
    write_json(out, {"machine": machine(), "rounds": rounds, "steps": steps, "global_batch": GLOBAL_BATCH,
                     "shapes": {k: dataclasses.asdict(v) for k, v in shapes.items()}, "skipped": skipped, "rows": rows})
    print(f"results: {out}")
    failed = sum(r["ratio"] is None for r in rows)
    if failed:
        sys.exit(f"{failed} of {len(rows)} rounds failed: their errors are in the log above and in {out}")


if __name__ == "__main__":
    main()
