"""What each mesh axis buys and costs on this machine, at world 4 (torch lowering, gloo):

    python -m benchmarks.mesh [--quick] [--seq-len 512] [--long 2048] [--steps 4] [--config.a.b=v ...]

On a machine with 4 GPUs, `python -m benchmarks.gpu` runs the same table on --backend cuda (NCCL).

For every setting: the bytes one rank sends per training step, per collective, against the axis's formula
(benchmarks/comm_bytes.py counts them where torch dispatches each collective); parameters + gradients +
optimizer state per rank, peak resident memory per rank, and tokens/s — each a fresh run of
`python -m portable_fsdp.run`, the same model, data and global batch, so tokens/s compare as ratios to fsdp4.
Dense settings run a Llama (hidden 256, 4 layers, 8 heads, 4 kv heads); MoE settings a Mixtral of the same
width (4 experts, top 2). `sp4` and `cp4` also run at a long sequence, where splitting the sequence pays.

Formulas (per rank and step; f(n) = (n-1)/n; U = bytes an FSDP unit gathers per rank — a tp slice under tensor
parallelism —, R = those of the units kept gathered from forward to backward: the root, and on CUDA the last layer;
activations B·s·h in fp32 with B the rank's sequences; L layers):
  FSDP over n ranks   all-gather (2U - R)·f(n), reduce-scatter U·f(n), summed over the units, each over the
                      ranks it shards over (experts under ep: fewer); HSDP adds an all-reduce 2·(U/n)·f(r)
  TP over t ranks     all-reduce (4·L + 1)·B·s·h·4 B · 2·f(t): per layer two in forward (after o_proj and
                      down_proj) and two in backward (the attention's input gradient, q, k and v's summed first,
                      and the MLP's, gate and up's: Megatron's count), plus lm_head's input gradient (vocabulary-
                      split lm_head)
  Ulysses SP over u   all-to-all 2·L·B·(s/u)·(2h + 2·kv)·4 B · f(u) (q, k, v and the output, forward and back)
  EP over e ranks     all-to-all 4·L·B·s·k·h·4 B · f(e) (dispatch and combine of k copies of each token, forward
                      and back; f(e) is the share routed off-rank when routing is uniform: the measured share
                      follows the router)
Context parallelism's exchange of keys and values depends on its rotate method (docs/context_parallel.md): its
rows count FSDP's formula only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile

from benchmarks.common import ROOT, fsdp_prefetch, machine, parse_benchmark_args, run_cli, table, torchrun, write_json

WORLD = 4
GLOBAL_BATCH = 4
DENSE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
QUICK = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
EXPERTS, TOP_K = 4, 2


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    plan: dict
    moe: bool = False
    long: bool = False  # also run at the long sequence

    def sizes(self) -> dict:
        return {axis: int(self.plan.get(f"plan.{axis}_size", 1)) for axis in ("tp", "sp", "cp", "ep", "dp_replicate")}


SETTINGS = [
    Setting("fsdp4", {}),
    Setting("fsdp2 x tp2", {"plan.tp_size": 2}),
    Setting("tp4", {"plan.tp_size": 4}),
    Setting("hsdp 2x2", {"plan.dp_replicate_size": 2}),
    Setting("sp4", {"plan.sp_size": 4}, long=True),
    Setting("cp4", {"plan.cp_size": 4, "plan.cp_impl": "portable"}, long=True),
    Setting("MoE fsdp4", {}, moe=True),
    Setting("MoE fsdp4 x ep2", {"plan.ep_size": 2}, moe=True),
    Setting("MoE fsdp4 x ep4", {"plan.ep_size": 4}, moe=True),
]


def f(n: int) -> float:
    return (n - 1) / n


def formula(setting: Setting, counted: dict, shape: dict, seq_len: int) -> dict:
    """Bytes per rank and step each collective should send, by the formulas of the module docstring."""
    sizes = setting.sizes()
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    rows = GLOBAL_BATCH // counted["dp_size"]
    expected = {**counted["fsdp_expected"], "all_to_all": 0.0}
    if sizes["tp"] > 1:
        expected["all_reduce"] += (4 * layers + 1) * rows * seq_len * h * 4 * 2 * f(sizes["tp"])
    if sizes["sp"] > 1:
        u = sizes["sp"]
        expected["all_to_all"] += 2 * layers * rows * (seq_len / u) * (2 * h + 2 * kv) * 4 * f(u)
    if sizes["ep"] > 1:
        expected["all_to_all"] += 4 * layers * rows * seq_len * TOP_K * h * 4 * f(sizes["ep"])
    return expected


def model_flags(shape: dict, moe_dir: str | None) -> list:
    if moe_dir:
        return [f"--config.model.init_from={moe_dir}"]
    return [f"--config.model.{key}={value}" for key, value in shape.items()]


def save_mixtral(shape: dict, directory: pathlib.Path) -> str:
    """A random Mixtral of the dense model's width, saved for model.init_from."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", vocab_size=384, max_position_embeddings=8192, sliding_window=None,
                                  num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def common_flags(seq_len: int, steps: int) -> list:
    return [f"--config.data.seq_len={seq_len}", f"--config.train.batch_size={GLOBAL_BATCH}",
            f"--config.train.eval_batch_size={GLOBAL_BATCH}", f"--config.train.steps={steps}",
            "--config.train.log_every=1", "--config.train.eval_every=0", "--config.train.eval_max_batches=1",
            "--config.train.warmup_steps=1", "--config.model.max_position_embeddings=8192"]


def count_bytes(flags: list, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        torchrun(WORLD, ["benchmarks.mesh_worker", f"{tmp}/bytes.json", backend, *flags,
                         "--config.plan.cpu_collectives=gloo"], timeout=1200)
        return json.loads(pathlib.Path(f"{tmp}/bytes.json").read_text())


def train(flags: list, backend: str) -> dict:
    records = run_cli(["--backend", backend, *flags], nproc=WORLD, timeout=1800)
    steps = [r for r in records if "loss" in r]
    last = steps[-1]
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steps[1:]),
            "peak_mb": max(last["peak_mem_mb"]), "final_loss": last["loss"]}


def measure(setting: Setting, shape: dict, moe_dir: str | None, seq_len: int, steps: int, backend: str) -> dict:
    flags = [*model_flags(shape, moe_dir), *common_flags(seq_len, steps),
             *(f"--config.{k}={v}" for k, v in setting.plan.items())]
    counted = count_bytes(flags, backend)
    expected = formula(setting, counted, shape, seq_len)
    return {"setting": setting.name, "seq_len": seq_len, "fsdp_prefetch": fsdp_prefetch(flags, WORLD, backend),
            **counted, "expected_per_step": expected,
            **train(flags, backend),
            "state_mb_per_rank": max(s + g for s, g in zip(counted["state_mb"], counted["grad_mb"]))}


def report(rows: list) -> str:
    base = {r["seq_len"]: r["tokens_per_sec"] for r in rows if r["setting"] == "fsdp4"}
    moe_base = next((r["tokens_per_sec"] for r in rows if r["setting"] == "MoE fsdp4"), None)
    lines = []
    for r in rows:
        sent, expected = r["sent_per_step"], r["expected_per_step"]
        measured_total = sum(sent.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))
        reference = moe_base if r["setting"].startswith("MoE") else base.get(r["seq_len"])
        volumes = (f"{sent.get(k, 0) / 1e6:.1f}" for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))
        lines.append([r["setting"], r["seq_len"], r.get("fsdp_prefetch", "-"), *volumes,
                      f"{sum(expected.values()) / 1e6:.1f}", f"{measured_total / max(sum(expected.values()), 1):.2f}",
                      f"{r['state_mb_per_rank']:.1f}", f"{r['peak_mb']:.0f}", f"{r['tokens_per_sec']:,.0f}",
                      f"{r['tokens_per_sec'] / reference:.2f}" if reference else "-"])
    headers = ["setting", "seq", "FSDP prefetch", "all-gather MB", "reduce-scatter MB", "all-reduce MB",
               "all-to-all MB", "formula MB", "measured / formula", "state MB/rank", "peak MB/rank", "tokens/s", "vs fsdp4"]
    return table(headers, lines)


def run_table(settings: list, shape: dict, lengths: tuple, steps: int, backend: str, on_error=None) -> list:
    """One row per setting (and per length for those that run at the long sequence too). `on_error(setting,
    error)`, when given, records a failed setting and goes on (the GPU script's budget); else it raises."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir = save_mixtral(shape, pathlib.Path(tmp) / "mixtral") if any(s.moe for s in settings) else None
        for setting in settings:
            for seq_len in lengths[:2 if setting.long or setting.name == "fsdp4" else 1]:
                try:
                    rows.append(measure(setting, shape, moe_dir if setting.moe else None, seq_len, steps, backend))
                except RuntimeError as err:
                    if on_error is None:
                        raise
                    on_error(setting, err)
                    continue
                print(f"{setting.name} L={seq_len}: {rows[-1]['sent_per_step']} "
                      f"{rows[-1]['tokens_per_sec']:,.0f} tokens/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 2 steps: checks the script, measures nothing")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--long", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated setting names")
    parser.add_argument("--report", help="print the table of a results JSON again (formulas recomputed)")
    args = parse_benchmark_args(parser)
    if args.report:
        saved = json.loads(pathlib.Path(args.report).read_text())
        settings = {s.name: s for s in SETTINGS}
        for row in saved["rows"]:
            row["expected_per_step"] = formula(settings[row["setting"]], row, saved["shape"], row["seq_len"])
        write_json(pathlib.Path(args.report), saved)
        print(report(saved["rows"]))
        return
    shape = QUICK if args.quick else DENSE
    lengths = (64, 128) if args.quick else (args.seq_len, args.long)
    steps = 2 if args.quick else args.steps
    chosen = [s for s in SETTINGS if not args.only or s.name in args.only.split(",")]
    rows = run_table(chosen, shape, lengths, steps, "cpu")
    out = pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_mesh_quick.json" if args.quick else \
        ROOT / "benchmarks" / "results" / "mesh.json"
    if args.only and out.is_file():  # refresh those settings' rows, keep the others'
        fresh = {(r["setting"], r["seq_len"]) for r in rows}
        rows = [r for r in json.loads(out.read_text())["rows"] if (r["setting"], r["seq_len"]) not in fresh] + rows
        rows.sort(key=lambda r: ([s.name for s in SETTINGS].index(r["setting"]), r["seq_len"]))
    print()
    print(report(rows))
    write_json(out, {"machine": machine(), "world_size": WORLD, "global_batch": GLOBAL_BATCH, "shape": shape,
                     "rows": rows})


if __name__ == "__main__":
    main()
