"""benchmarks/peers.py without the peers: reading their logs, which pairs run, the summary, the flags' errors.
(The peers themselves are not installed in CI; a run with them is what docs/benchmarks.md reports.)"""
import json
import subprocess
import sys

import pytest

from benchmarks import peers
from benchmarks.common import ROOT

SHAPE = peers.Shape(64, 160, 2, 4, 2, 64)
TOKENS = peers.GLOBAL_BATCH * SHAPE.seq_len


def test_torchtitan_lines_give_global_step_times_and_losses():
    # torchtitan's colours, and every rank logging the same step (the first one of each step counts)
    log = "\n".join([
        "\x1b[31mstep:  1  \x1b[32mloss:  5.95000  \x1b[33mgrad_norm:  1.0  memory:  0.10GiB(0.1%)  \x1b[34mtps: 64  tflops: 0.00",
        "\x1b[31mstep:  1  \x1b[32mloss:  5.95000  \x1b[33mgrad_norm:  1.0  memory:  0.10GiB(0.1%)  \x1b[34mtps: 99  tflops: 0.00",
        "step:  2  loss:  5.50000  grad_norm:  1.0  memory:  0.10GiB(0.1%)  tps: 1,024  tflops: 0.00",
        "step:  3  loss:  5.25000  grad_norm:  1.0  memory:  0.10GiB(0.1%)  tps: 2,048  tflops: 0.00",
        "step:  4  loss:  5.00000  grad_norm:  1.0  memory:  0.10GiB(0.1%)  tps: 2,048  tflops: 0.00"])
    result = peers.parse_torchtitan(log, nproc=2, shape=SHAPE)
    assert result["losses"] == [5.95, 5.5, 5.25, 5.0]
    assert result["step_seconds"][0] == pytest.approx(TOKENS / 128)  # 64 tokens/s on each of 2 ranks
    assert result["tokens_per_sec"] == pytest.approx(4096)  # steps 3-4: 2,048 per rank


def test_maxtext_lines_give_step_times_and_losses():
    log = "\n".join(f"completed step: {n}, seconds: {s}, TFLOP/s/device: 0.001, Tokens/s/device: 1.0, "
                    f"total_weights: 512, loss: {loss}, lm_loss: {loss}, perplexity: 100.0"
                    for n, s, loss in [(0, 9.0, 5.9), (1, 1.0, 5.5), (2, 0.5, 5.1), (3, 0.25, 4.8)])
    result = peers.parse_maxtext(log, SHAPE)
    assert result["losses"] == [5.9, 5.5, 5.1, 4.8]
    assert result["tokens_per_sec"] == pytest.approx(TOKENS / 0.375)  # the median of the steps after the first two


@pytest.mark.parametrize("parse", [lambda log: peers.parse_torchtitan(log, 2, SHAPE),
                                   lambda log: peers.parse_maxtext(log, SHAPE)])
def test_a_log_without_steps_is_an_error_not_an_empty_result(parse):
    with pytest.raises(RuntimeError, match="no step lines"):
        parse("Traceback (most recent call last):\nValueError: boom")


def test_pairs_skip_a_peer_without_an_interpreter_in_one_line(tmp_path):
    found, skipped = peers.pairs(None, None, tmp_path)
    assert [pair.name for pair in found] == ["ours / HF Trainer, 2 ranks"]
    assert len(skipped) == 2 and all("\n" not in line for line in skipped)
    assert "torchtitan" in skipped[0] and "--torchtitan-python" in skipped[0]
    found, skipped = peers.pairs("/venv/bin/python", "/mt/bin/python", tmp_path)
    assert [(pair.peer, pair.ranks) for pair in found] == [("torchtitan 0.3.0", 2), ("torchtitan 0.3.0", 1),
                                                           ("torchtitan 0.3.0", 2), ("HF Trainer (FSDP2)", 2),
                                                           ("MaxText 0.2.5", 2)]
    assert "gloo's collectives" in found[2].name
    assert skipped == []


def test_rounds_alternate_which_side_runs_first_and_the_summary_takes_medians():
    order = []

    def side(name, tokens_per_sec):
        def run(shape, steps):
            order.append(name)
            return {"tokens_per_sec": tokens_per_sec.pop(0), "step_seconds": [1.0] * steps,
                    "losses": [6.0 - 0.1 * i for i in range(steps)] if name == "ours" else [6.2 - 0.1 * i for i in range(steps)]}
        return run

    pair = peers.Pair("ours / peer, 2 ranks", "peer", 2, side("ours", [110, 130, 120]), side("peer", [100, 100, 100]))
    rows = peers.measure([pair], {"s": SHAPE}, rounds=3, steps=4, report=lambda line: None)
    assert order == ["ours", "peer", "peer", "ours", "ours", "peer"]
    [row] = peers.summary(rows)
    assert row[4] == "1.10, 1.30, 1.20" and row[5] == "1.20x"
    assert row[6] == "5.700 / 5.900" and row[7] == "0.200"


def test_shared_inputs_are_our_corpus_and_byte_tokenizer(tmp_path):
    folder = peers.corpus_and_tokenizer(tmp_path)
    lines = (folder / "tests/assets/c4_test/train.jsonl").read_text().splitlines()
    assert len(lines) > 10 and all(json.loads(line)["text"].strip() for line in lines)
    tokenizer = json.loads((folder / "tests/assets/tokenizer/tokenizer_config.json").read_text())
    assert tokenizer  # transformers' format, which torchtitan and MaxText load


@pytest.mark.parametrize("flags, message", [
    (["--torchtitan-python", "/no/such/python"], "--torchtitan-python: /no/such/python is not a file"),
    (["--maxtext-python", "/no/such/python"], "--maxtext-python: /no/such/python is not a file"),
    (["--shapes", "3.3M,9B"], "--shapes: unknown 9B; choose among 3.3M,25M"),
    (["--steps", "7"], "--steps: 7 is too few; give at least 8"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peers", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith(message)


def test_a_failed_peer_is_reported_by_its_workers_error_not_torchruns_summary(monkeypatch, tmp_path):
    stderr = ("Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
              "ValueError: seq_len 4096 exceeds max_seq_len 1024\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "============================================================\n")
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr=stderr)
    monkeypatch.setattr(peers, "run_python", lambda *args, **kwargs: failed)
    with pytest.raises(RuntimeError, match="^torchtitan failed: ValueError: seq_len 4096 exceeds max_seq_len 1024$"):
        peers.run_torchtitan(sys.executable, tmp_path, SHAPE, 8, 2)


def test_a_failed_run_is_its_rounds_error_line_and_the_other_runs_go_on():
    calls = {"peer": 0}

    def ours(shape, steps):
        return {"tokens_per_sec": 120.0, "step_seconds": [1.0] * steps, "losses": [6.0, 5.0]}

    def flaky_peer(shape, steps):
        calls["peer"] += 1
        if calls["peer"] == 2:
            raise RuntimeError("torchtitan failed: RuntimeError: Connection closed by peer")
        return {"tokens_per_sec": 100.0, "step_seconds": [1.0] * steps, "losses": [6.1, 5.2]}

    def broken(shape, steps):
        raise subprocess.TimeoutExpired(["python"], 3600)

    lines = []
    rows = peers.measure([peers.Pair("ours / peer, 2 ranks", "peer", 2, ours, flaky_peer),
                          peers.Pair("ours / broken, 2 ranks", "broken", 2, ours, broken)],
                         {"s": SHAPE}, rounds=3, steps=4, report=lines.append)
    assert len(rows) == 6 and calls["peer"] == 3
    assert lines[2] == ("round 2 s ours / peer, 2 ranks: peer failed: torchtitan failed: RuntimeError: Connection "
                        "closed by peer")
    assert lines[1] == "round 1 s ours / broken, 2 ranks: peer failed: timed out after 3600 s"
    flaky, never = peers.summary(rows)
    assert flaky[3:6] == ["100, failed, 100", "1.20, -, 1.20", "1.20x"]
    assert never[3:] == ["failed, failed, failed", "-, -, -", "-", "-", "-"]
