"""Metrics: the model-FLOPs formula, the JSONL log, the progress bar and the end-of-run summary."""
from __future__ import annotations

import datetime
import json
import pathlib
import sys
import time


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of `model` (a `portable_fsdp.backend.ModelInfo`): 6·N for the matmuls of forward
    + backward, N the weights a token's forward multiplies by (`ModelInfo.n_active_params`: without the input
    embedding table, a lookup — with tied embeddings the table is the lm_head's matmul and stays in N — and, in a
    mixture of experts, only the top-k of the routed experts), plus 12·L·d·T for the attention scores and weighted
    sum (PaLM's formula, as torchtitan counts it, no causal discount). MFU and the estimator both use it."""
    return 6.0 * model.n_active_params + 12.0 * model.n_layers * model.hidden_size * seq_len


class MetricsLog:
    """One JSON object per line in <workdir>/metrics.jsonl, written by rank 0 only; `trackers` (rank 0's
    portable_fsdp.training.trackers.Trackers, or None) receive the same records."""

    def __init__(self, workdir: pathlib.Path, enabled: bool, trackers=None):
        self.enabled = enabled
        self._file = open(workdir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None
        self._trackers = trackers if enabled else None

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._trackers:
            self._trackers.log(record)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._trackers:
            self._trackers.close()


class Progress:
    """Rank 0's progress: a tqdm bar (stderr) when stdout is a terminal; otherwise (a file, SLURM, k8s, a pipe)
    one grep-able `key=value` line per logged step on stdout, which a bar would fill with carriage returns.
    Silent on other ranks or when switched off."""

    def __init__(self, total: int, initial: int, enabled: bool):
        terminal = sys.stdout.isatty()
        self._bar = None
        self._lines = enabled and not terminal
        self._total, self._initial, self._began = total, initial, time.perf_counter()
        if enabled and terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, postfix: dict) -> None:
        if self._bar:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def log(self, record: dict) -> None:
        """One line for a logged step's record (the keys MetricsLog writes)."""
        if self._lines:
            done = record["step"] - self._initial
            eta = (time.perf_counter() - self._began) / done * (self._total - record["step"]) if done else 0.0
            print(progress_line(record, self._total, eta), flush=True)

    def close(self) -> None:
        if self._bar:
            self._bar.close()


def progress_line(record: dict, total: int, eta_seconds: float) -> str:
    """`step 40/300 loss=3.1234 grad_norm=0.812 lr=2.9e-04 tok/s=10543 mfu=1.2% mem=812MiB eta=0:01:23`: fixed
    fields, so a log is grep-able; mem is the highest peak over the ranks."""
    peak = max(record.get("peak_mem_mb") or [0.0])
    eta = datetime.timedelta(seconds=round(eta_seconds))
    return (f"step {record['step']}/{total} loss={record['loss']:.4f} grad_norm={record['grad_norm']:.3f} "
            f"lr={record['lr']:.1e} tok/s={record['tokens_per_sec']:.0f} mfu={100 * record['mfu']:.1f}% "
            f"mem={peak:.0f}MiB eta={eta}")


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def summary(records: dict) -> str:
    width = max(len(k) for k in records)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in records.items())
