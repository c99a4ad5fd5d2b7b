"""The estimate as the user reads it: the per-rank table, the step's FLOPs and time, and the verdict line."""
from __future__ import annotations

import json

from portable_fsdp.machine import hardware
from portable_fsdp.estimate.process import Report
from portable_fsdp.estimate.target import Target
from portable_fsdp.training.metrics import flops_per_token
from portable_fsdp.config.validate import resolve_plan

ROWS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
        ("activations", "activations"), ("program_temporaries", "activations, temporaries"),
        ("gathered", "gathered parameters"),
        ("unsharded_gradients", "unsharded gradients"), ("temporaries", "temporaries"),
        ("inputs", "program inputs"), ("outputs", "program outputs"))
HELD = ("parameters", "gradients", "optimizer")


def verdict(report: Report, fitting: list) -> str:
    target = report.target
    if target.device == "cpu":
        memory = (f"{format_bytes(target.memory * target.nproc)} of host memory shared by {target.nproc} ranks, less "
                  f"{target.headroom:.0%} headroom")
    else:
        memory = f"{device_name(target)}: {format_bytes(target.memory)} less {target.headroom:.0%} headroom"
    where = f"{format_bytes(target.usable)} usable per rank ({memory})"
    if report.fits:
        return f"fits: peak {format_bytes(report.peak)} per rank, {where}"
    line = f"does not fit: peak {format_bytes(report.peak)} per rank exceeds {where}"
    if fitting:
        return line + "; settings that fit: " + "; ".join(
            f"{a.words} (peak {format_bytes(r.peak)})" for a, r in fitting)
    return line + "; none of the settings tried fits (more ranks, activation checkpointing, CPU offload, smaller " \
                  "micro-batches, tp/cp): use a device with more memory or a smaller model"


def device_name(target: Target) -> str:
    if target.device == "cpu":
        return "host memory"
    entry = hardware.datasheet_entry(target.label)
    return entry[0] if entry else target.label


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def mesh_words(plan) -> str:
    mesh = plan.mesh
    axes = [f"{name} {size}" for name, size in mesh.axes() if size > 1 or name == "fsdp"]
    if mesh.ep_size > 1:
        axes.append(f"ep {mesh.ep_size} (of fsdp{' x tp' if mesh.tp_size > 1 else ''})")
    return " x ".join(axes)


def rank_groups(ranks: list) -> list:
    """[(rank numbers, their estimate)] with ranks of identical numbers together."""
    groups: list = []
    for rank in ranks:
        key = json.dumps({k: v for k, v in rank.items() if k not in ("rank", "seconds")}, sort_keys=True)
        for numbers, first, seen in groups:
            if seen == key:
                numbers.append(rank["rank"])
                break
        else:
            groups.append(([rank["rank"]], rank, key))
    return [(numbers, first) for numbers, first, _ in groups]


def rank_words(numbers: list, world: int, every_device: bool) -> str:
    if every_device:
        return f"every device (0-{world - 1})" if world > 1 else "device 0"
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"ranks {numbers[0]}-{numbers[-1]}"
    return "ranks " + ", ".join(map(str, numbers))


def table(rank: dict, unit: int, unit_name: str, usable: float, offloaded: bool) -> list:
    lines = [f"  {'':<22}{'held':>10}{'at peak':>10}   ({unit_name})"]
    held = rank.get("held", {})
    for key, name in ROWS:
        if key not in rank["at_peak"] and key not in held:
            continue
        if key in ("inputs", "outputs") and not rank["at_peak"].get(key):
            continue
        at_peak = "host" if offloaded and key in HELD else f"{rank['at_peak'].get(key, 0) / unit:.2f}"
        lines.append(f"  {name:<22}{(f'{held[key] / unit:.2f}' if key in held else '-'):>10}{at_peak:>10}")
    share = rank["peak"] / usable if usable else 0
    lines.append(f"  {'peak':<22}{'':>10}{rank['peak'] / unit:>10.2f}   ({share:.0%} of usable)")
    if offloaded:
        host = sum(held.get(k, 0) for k in HELD)
        lines.append(f"  host memory (offloaded parameters, gradients, AdamW state): {host / unit:.2f} {unit_name}")
    return lines


def step_line(report: Report, mfu: float) -> str:
    config, target = report.config, report.target
    plan = resolve_plan(config, target.nproc)
    tokens = config.train.batch_size * config.data.seq_len
    flops = flops_per_token(report.model, config.data.seq_len) * tokens
    dtype = plan.mixed_precision.param_dtype
    rate = config.train.peak_flops_per_device or (0 if target.device == "cpu"
                                                  else hardware.datasheet_flops(target.label, dtype))
    active = "" if report.model.n_active_params + report.model.n_embedding_params == report.model.n_params else \
        f", N = {report.model.n_active_params:,.0f} active parameters"
    text = f"step: {flops:.3g} FLOPs ({tokens:,} tokens; 6N + attention, portable_fsdp.training.metrics{active})"
    if not rate:
        return text + f"; no peak FLOP/s known for {target.label} in {dtype}: set train.peak_flops_per_device"
    seconds = flops / (target.nproc * rate * mfu)
    return text + f" -> {seconds:.3g} s per step at {mfu:.0%} MFU ({rate / 1e12:.0f} TFLOP/s {dtype} per device)"


def render(report: Report, mfu: float, recipe: str) -> str:
    config, target, result = report.config, report.target, report.result
    plan = resolve_plan(config, target.nproc)
    model = report.model
    first = result["ranks"][0]
    split = (f" ({first['tokens_per_rank']} tokens after splitting the sequence)" if plan.mesh.sequence_size > 1
             else "")
    if target.device == "cpu":
        where = f"{target.nproc} rank(s) sharing host memory ({format_bytes(target.memory)} each)"
    else:
        where = f"{target.nproc} x {device_name(target)} ({format_bytes(target.memory)} each)"
    lines = [f"estimate: {recipe}, --backend {target.backend}, {where}",
             f"model: {model.root_class}, {model.n_params:,} parameters; mesh {mesh_words(plan)}; "
             f"micro-batch {first['micro_batch_rows']} x {config.data.seq_len} tokens per rank{split}, "
             f"{config.train.grad_accum_steps} micro-batch(es) per step; compute {plan.mixed_precision.param_dtype}, float32 master "
             "weights",
             f"method: {result['method']}"]
    unit, unit_name = (2**30, "GiB") if report.peak >= 2**30 else (2**20, "MiB")
    every_device = result.get("same_on_every_device", False)
    for numbers, rank in rank_groups(result["ranks"]):
        lines.append("")
        lines.append(rank_words(numbers, target.nproc, every_device))
        lines += table(rank, unit, unit_name, target.usable, bool(rank.get("cpu_offload")))
    traced = [r["rank"] for r in result["ranks"]]
    if not every_device and len(traced) < target.nproc:
        lines.append(f"  (traced ranks {', '.join(map(str, traced))}: every FSDP shard is padded to one size, so "
                     "the ranks between hold the same; --ranks all traces each)")
    lines.append("")
    lines.append(step_line(report, mfu))
    if "expert_flops_per_token" in result:
        lines.append(expert_flops_line(result["expert_flops_per_token"]))
    return "\n".join(lines)


def expert_flops_line(counted: dict) -> str:
    """The expert FLOPs per token a backend's MoE kernel executes (its shapes), against the active ones 6N counts."""
    ratio = counted["executed"] / counted["active"]
    return (f"experts: {counted['executed']:.3g} FLOPs per token executed, {ratio:.2f}x the {counted['active']:.3g} "
            "of a token's top-k experts (padding, and room for every token the ep ranks could send)")
