"""Experiment trackers (`train.report_to`): TensorBoard and Weights & Biases receive rank 0's records.

metrics.jsonl stays the record of truth; a tracker gets the same records, keyed by their step, from global rank 0
only (process 0 under SPMD / JAX). `train.report_to` means what Hugging Face TrainingArguments' `report_to` means:
`none`, `all` (every tracker that is installed), or tracker names, comma-separated. A named tracker that is not
installed is refused at start-up, before any worker starts. The packages are imported only where a tracker opens.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import uuid

from portable_fsdp.errors import UserError

# tracker name -> (module that must import, what to pip install)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
# Memory lists (one entry per rank or device) become `<key>/max` and, up to this many ranks, `<key>/rank_<i>`.
PER_RANK_LIMIT = 16
WANDB_RUN_ID = "wandb_run_id"  # in the workdir: a resumed run continues the same W&B run


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve(report_to) -> list:
    """`train.report_to` (a string, comma-separated, or a list) -> the tracker names to open. Raises UserError
    for an unknown name or a named tracker that is not installed."""
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    if not names or names == ["none"]:
        return []
    if "all" in names:  # as Hugging Face: every integration that is installed, none when none is
        return [name for name, (module, _) in TRACKERS.items() if installed(module)]
    for name in names:
        if name not in TRACKERS:
            raise UserError("train.report_to", (f"unknown tracker {name!r}; choose none, all, tensorboard, wandb or "
                                                "tensorboard,wandb"))
    for name in names:
        module, package = TRACKERS[name]
        if not installed(module):
            raise UserError("train.report_to", (f"{name} is not installed; pip install {package} "
                                                f"(or leave {name} out of train.report_to)"))
    return list(dict.fromkeys(names))


def scalars(record: dict) -> dict:
    """A metrics.jsonl record -> {tag: number}: its numbers under Hugging Face Trainer's names (`hf_tag`); a list
    per rank as its max and, up to PER_RANK_LIMIT ranks, one scalar per rank. `step` is the key, not a value; text
    (`event`) is left out."""
    evaluation = "eval_loss" in record
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[hf_tag(key, evaluation)] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            tag = hf_tag(key, evaluation)
            out[f"{tag}/max"] = max(value)
            if len(value) <= PER_RANK_LIMIT:
                out.update({f"{tag}/rank_{i}": v for i, v in enumerate(value)})
    return out


def hf_tag(key: str, evaluation: bool) -> str:
    """As transformers' `rewrite_logs` names what Trainer sends to TensorBoard and W&B: `eval_loss` -> `eval/loss`,
    `test_x` -> `test/x`, anything else `train/<key>`; an eval record's unprefixed numbers (perplexity) are eval/."""
    for prefix in ("eval_", "test_"):
        if key.startswith(prefix):
            return f"{prefix[:-1]}/{key[len(prefix):]}"
    return f"{'eval' if evaluation else 'train'}/{key}"


class TensorBoard:
    """Event files in WORKDIR/tensorboard. On resume the writer purges what an earlier run logged after the
    checkpoint's step, so the curves continue from it without a doubled stretch."""

    def __init__(self, workdir: pathlib.Path, config: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # the records of the checkpoint's own step were logged before it was saved: they stay
        self._writer = SummaryWriter(str(workdir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        rows = "\n".join(f"| {k} | {json.dumps(v, default=str)} |" for k, v in config.items())
        self._writer.add_text("config", f"| field | value |\n| --- | --- |\n{rows}", global_step=start_step)
        self._writer.flush()

    def log(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # a run that is killed keeps what it logged

    def close(self) -> None:
        self._writer.close()


class WandB:
    """`wandb.init(project=train.wandb_project or "portable_fsdp", name=<workdir name>, dir=WORKDIR)`; WANDB_MODE
    (offline, disabled) is wandb's own to honour. A resumed run continues the W&B run whose id the workdir
    keeps; W&B drops steps at or below the last one it holds (TensorBoard rewinds, W&B does not)."""

    def __init__(self, workdir: pathlib.Path, config: dict, start_step: int, project: str, resume: bool):
        import wandb

        id_file = workdir / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        run_id = run_id or uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
        id_file.write_text(run_id + "\n")
        try:
            self._run = wandb.init(project=project or "portable_fsdp", name=workdir.resolve().name, dir=str(workdir),
                                   id=run_id, resume="allow")
        except Exception as err:  # no API key, no network: one line naming the way out
            raise UserError("train.report_to", (f"wandb could not start ({type(err).__name__}: {err}); run `wandb login`, "
                                                "or set WANDB_MODE=offline")) from None
        self._run.config.update(config, allow_val_change=True)  # a resumed run may change a field

    def log(self, step: int, values: dict) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class Trackers:
    """Every open tracker; `log(record)` takes a metrics.jsonl record."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, record: dict) -> None:
        values = scalars(record)
        if values and "step" in record:
            for tracker in self.trackers:
                tracker.log(int(record["step"]), values)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(config, workdir: pathlib.Path, start_step: int, run_info: dict | None = None) -> Trackers | None:
    """The trackers `config.train.report_to` names, opened (rank 0 only: the caller decides); None when none is."""
    from portable_fsdp.config.schema import flat_fields

    names = resolve(config.train.report_to)
    if not names:
        return None
    fields = {**(run_info or {}), **flat_fields(config)}
    opened = []
    for name in names:
        if name == "tensorboard":
            opened.append(TensorBoard(pathlib.Path(workdir), fields, start_step))
        else:
            opened.append(WandB(pathlib.Path(workdir), fields, start_step, config.train.wandb_project,
                                config.train.resume))
    return Trackers(opened)
