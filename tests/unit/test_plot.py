"""`python -m portable_fsdp.plot`: the lines each panel gets from metrics.jsonl (one per run, one per rank for
memory), the PNG it writes, and its errors (one `error:` line, exit 2)."""
import json
import os

import pytest

from portable_fsdp import plot


def write_run(workdir, records, tail=""):
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return workdir


def records(scale=1.0, ranks=2):
    out = [{"step": 0, "event": "start", "peak_mem_mb": [100.0 + r for r in range(ranks)]}]
    for step in (5, 10):
        out.append({"step": step, "loss": scale * (6 - step / 5), "lr": 1e-3 * step, "tokens_per_sec": 1000.0 + step,
                    "grad_norm": scale, "mfu": 0.01 * scale, "peak_mem_mb": [200.0 + step + r for r in range(ranks)]})
    out.append({"step": 10, "eval_loss": scale * 4.0, "eval_tokens": 512, "perplexity": 54.6})
    out.append({"step": 10, "event": "end", "step_seconds_median": 0.1, "bookkeeping_fraction": 0.01})
    return out


def test_lines_one_per_run_per_panel_and_one_per_rank_for_memory(tmp_path):
    runs = {"a": records(), "b": records(2.0)}
    panels = plot.lines(runs)
    assert set(panels) == {key for key, _ in plot.PANELS}
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu"):
        assert [(run, label, steps) for run, label, steps, _ in panels[key]] == [("a", "a", [5, 10]),
                                                                               ("b", "b", [5, 10])]
    assert panels["loss"][1][3] == [10.0, 8.0]
    assert panels["mfu"][1][3] == [0.02, 0.02]
    assert [(label, steps, values) for _, label, steps, values in panels["eval_loss"]] == [("a", [10], [4.0]),
                                                                                         ("b", [10], [8.0])]
    assert panels["peak_mem_mb"] == [
        ("a", "a rank 0", [0, 5, 10], [100.0, 205.0, 210.0]), ("a", "a rank 1", [0, 5, 10], [101.0, 206.0, 211.0]),
        ("b", "b rank 0", [0, 5, 10], [100.0, 205.0, 210.0]), ("b", "b rank 1", [0, 5, 10], [101.0, 206.0, 211.0])]


def test_overlapping_runs_keep_their_own_colour_and_marker_in_every_panel():
    fig = plot.figure(plot.lines({"runs/a": records(), "runs/b": records()}))  # the same curves: they overlap
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(axes) == {title for _, title in plot.PANELS}
    assert {"gradient norm (before clipping)", "MFU (fraction of peak FLOPs)"} <= set(axes)
    for title in ("training loss", "gradient norm (before clipping)", "MFU (fraction of peak FLOPs)"):
        drawn = axes[title].get_lines()
        assert [text.get_text() for text in axes[title].get_legend().get_texts()] == ["runs/a", "runs/b"]
        assert drawn[0].get_color() != drawn[1].get_color() and drawn[0].get_marker() != drawn[1].get_marker()
    memory = axes["peak memory per rank (MiB)"].get_lines()  # a run's ranks: its colour, one line style each
    assert [(line.get_label(), line.get_color() == memory[0].get_color(), line.get_linestyle()) for line in memory] == [
        ("runs/a rank 0", True, "-"), ("runs/a rank 1", True, "--"), ("runs/b rank 0", False, "-"),
        ("runs/b rank 1", False, "--")]
    assert [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()] == ["step", "step"]


def test_many_ranks_are_drawn_as_largest_and_smallest():
    ranks = plot.PER_RANK_LINES + 1
    [largest, smallest] = plot.lines({"a": records(ranks=ranks)})["peak_mem_mb"]
    assert largest == ("a", "a max", [0, 5, 10], [100.0 + ranks - 1, 205.0 + ranks - 1, 210.0 + ranks - 1])
    assert smallest == ("a", "a min", [0, 5, 10], [100.0, 205.0, 210.0])


def test_a_resumed_run_keeps_the_last_record_of_each_step(tmp_path):
    resumed = records() + [{"step": 10, "loss": 3.0}, {"step": 15, "loss": 2.5}]  # logged again after a resume
    [(_, label, steps, values)] = plot.lines({"a": resumed})["loss"]
    assert (steps, values) == ([5, 10, 15], [5.0, 3.0, 2.5])


def test_a_line_being_written_is_left_out(tmp_path):
    workdir = write_run(tmp_path / "w", records(), tail='{"step": 15, "lo')
    assert plot.read_records(workdir) == records()


def test_two_runs_into_one_png(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", records()), write_run(tmp_path / "b", records(2.0))
    out = tmp_path / "both.png"
    assert plot.main([str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_default_outputs(tmp_path, monkeypatch):
    a = write_run(tmp_path / "a", records())
    write_run(tmp_path / "b", records(2.0))
    assert plot.main([str(a)]) == 0
    assert (a / "metrics.png").stat().st_size > 0
    monkeypatch.chdir(tmp_path)
    assert plot.main(["a", "b"]) == 0
    assert (tmp_path / "runs.png").stat().st_size > 0


def unreadable(tmp_path):
    workdir = write_run(tmp_path / "locked", records())
    os.chmod(workdir / "metrics.jsonl", 0)
    return workdir


@pytest.mark.parametrize("make,expected", [
    (lambda t: t / "missing", "{w}: no such directory; give the --workdir of a run"),
    (lambda t: (t / "empty").mkdir() or t / "empty",
     "{w}: holds no metrics.jsonl; give the --workdir of a run that has started"),
    (lambda t: write_run(t / "bad", [{"step": 1}], tail="not json\n"), "{w}: metrics.jsonl line 2 is not JSON (Expecting value)"),
    (lambda t: write_run(t / "nostep", [{"loss": 1.0}]), "{w}: metrics.jsonl line 1 is not a record with a step"),
    (lambda t: write_run(t / "none", []), "{w}: metrics.jsonl has no records yet"),
    pytest.param(unreadable, "{w}: cannot read metrics.jsonl (Permission denied)",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")),
])
def test_errors_are_one_line(tmp_path, capsys, make, expected):
    good = write_run(tmp_path / "good", records())
    workdir = make(tmp_path)
    assert plot.main([str(good), str(workdir), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: " + expected.format(w=workdir)]
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("args,expected", [
    ([], "error: command line: the following arguments are required: WORKDIR"),
    (["{good}", "--out", "{good}/x.txt"], "error: --out: {good}/x.txt is not a .png file name"),
    (["{good}", "--out", "{good}/no/x.png"], "error: --out: {good}/no is not a directory"),
])
def test_argument_errors(tmp_path, capsys, args, expected):
    good = write_run(tmp_path / "good", records())
    assert plot.main([a.format(good=good) for a in args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [expected.format(good=good)]
