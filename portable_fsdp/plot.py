"""`python -m portable_fsdp.plot WORKDIR [WORKDIR ...] [--out FILE.png]`

Draws what runs logged in WORKDIR/metrics.jsonl over their steps — training loss, eval loss, learning rate,
gradient norm, tokens/s, MFU and peak memory per rank — into one PNG, several runs overlaid, each in its own colour
and marker, with a legend naming each workdir.
Default output: WORKDIR/metrics.png for one run, runs.png in the current directory for several.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from portable_fsdp.errors import UserError
from portable_fsdp.cli import Parser

# (metrics.jsonl key, panel title). peak_mem_mb is a list, one entry per rank (per device under SPMD / JAX).
PANELS = (("loss", "training loss"), ("eval_loss", "eval loss"), ("lr", "learning rate"),
          ("grad_norm", "gradient norm (before clipping)"), ("tokens_per_sec", "tokens/s"),
          ("mfu", "MFU (fraction of peak FLOPs)"), ("peak_mem_mb", "peak memory per rank (MiB)"))
# Each run's marker (its colour comes from matplotlib's cycle), so overlapping runs stay apart in grey print too.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# A run's ranks in the memory panel: its colour, one line style each.
RANK_STYLES = ("-", "--", ":", "-.")
# Above this many ranks a run's memory is drawn as its largest and smallest rank, not one line per rank.
PER_RANK_LINES = 8


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), or one line naming the install."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("matplotlib", "is not installed; pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: pathlib.Path, title: str = "") -> None:
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def read_records(workdir: pathlib.Path) -> list:
    """The records of WORKDIR/metrics.jsonl, the last one logged for each step kept (a resumed run logs again
    from its checkpoint's step), in step order. A last line without its newline (a run still writing) is left
    out; anything else that does not parse is an error."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not pathlib.Path(workdir).is_dir():
        raise UserError(str(workdir), "no such directory; give the --workdir of a run")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(str(workdir), "holds no metrics.jsonl; give the --workdir of a run that has started") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(str(workdir), f"cannot read metrics.jsonl ({getattr(err, 'strerror', None) or err})") from None
    records = []
    for number, line in enumerate(text.split("\n")[:-1], 1):  # the part after the last newline is being written
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(str(workdir), f"metrics.jsonl line {number} is not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UserError(str(workdir), f"metrics.jsonl line {number} is not a record with a step")
        records.append(record)
    if not records:
        raise UserError(str(workdir), "metrics.jsonl has no records yet")
    return records


def lines(runs: dict) -> dict:
    """{run name: records} -> {panel key: [(run, label, steps, values), ...]}: one line per run in each panel that
    run logged, and in the memory panel one per rank (or the largest and smallest rank past PER_RANK_LINES ranks)."""
    out = {key: [] for key, _ in PANELS}
    for name, records in runs.items():
        for key, _ in PANELS:
            by_step = {}
            for record in records:
                if isinstance(record.get(key), (int, float, list)):
                    by_step[record["step"]] = record[key]  # the last record of a step wins (resume)
            if not by_step:
                continue
            steps = sorted(by_step)
            if key != "peak_mem_mb":
                out[key].append((name, name, steps, [by_step[s] for s in steps]))
                continue
            ranks = max(len(v) if isinstance(v, list) else 1 for v in by_step.values())
            per_step = [v if isinstance(v, list) else [v] for v in (by_step[s] for s in steps)]
            if ranks <= PER_RANK_LINES:
                for rank in range(ranks):
                    kept = [(s, v[rank]) for s, v in zip(steps, per_step) if rank < len(v)]
                    out[key].append((name, f"{name} rank {rank}", [s for s, _ in kept], [v for _, v in kept]))
            else:
                out[key].append((name, f"{name} max", steps, [max(v) for v in per_step]))
                out[key].append((name, f"{name} min", steps, [min(v) for v in per_step]))
    return out


def figure(panels: dict):
    """The figure of `lines(...)`: a panel per PANELS entry; each run keeps one colour and marker in every panel."""
    plt = pyplot()
    runs = list(dict.fromkeys(run for drawn in panels.values() for run, *_ in drawn))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(4, 2, figsize=(11, 12), sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS):
        for index, (run, name, steps, values) in enumerate(panels[key]):
            number = runs.index(run)
            rank = sum(1 for other, *_ in panels[key][:index] if other == run)
            ax.plot(steps, values, label=name, color=colours[number % len(colours)],
                    marker=MARKERS[number % len(MARKERS)], markevery=max(1, len(steps) // 12), markersize=4,
                    linestyle=RANK_STYLES[rank % len(RANK_STYLES)])
        ax.set_title(label, fontsize=10)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if not panels[key]:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif len(panels[key]) > 1:
            ax.legend(fontsize=7)
    axes[3, 1].axis("off")  # seven panels: the one above the empty slot shows the steps
    axes[2, 1].xaxis.set_tick_params(labelbottom=True)
    for ax in (axes[3, 0], axes[2, 1]):
        ax.set_xlabel("step")
    return fig


def draw(panels: dict, path: pathlib.Path, title: str) -> None:
    save_figure(figure(panels), path, title)


def main(argv=None) -> int:
    parser = Parser(prog="python -m portable_fsdp.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="the --workdir of a run (several: overlaid)")
    parser.add_argument("--out", default=None, help="the PNG to write (default: WORKDIR/metrics.png for one run, "
                                                    "runs.png for several)")
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        runs = {}
        for workdir in args.workdirs:
            name = str(workdir).rstrip("/") or str(workdir)
            runs[name if name not in runs else f"{name} ({len(runs)})"] = read_records(pathlib.Path(workdir))
        out = pathlib.Path(args.out) if args.out else (
            pathlib.Path(args.workdirs[0]) / "metrics.png" if len(args.workdirs) == 1 else pathlib.Path("runs.png"))
        if out.suffix.lower() != ".png":
            raise UserError("--out", f"{out} is not a .png file name")
        if not out.parent.is_dir():
            raise UserError("--out", f"{out.parent} is not a directory")
        draw(lines(runs), out, ", ".join(runs))
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
