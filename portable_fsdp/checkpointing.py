"""The on-disk checkpoint layout every backend shares, and how a save is made atomic.

<workdir>/checkpoints/step_00000100/   one complete checkpoint (manifest.json written last)
<workdir>/checkpoints/latest          the name of the newest complete one
A save writes into `.tmp-step_…`, fsyncs, writes the manifest with checksums, then renames:
a crash at any moment leaves the previous checkpoint and `latest` untouched.

Inside a checkpoint, the same on every backend:
  model.safetensors + config.json    FULL_STATE_DICT: what `from_pretrained` loads (transformers names)
  optimizer.pt                       FULL_STATE_DICT: torch's full optimizer state dict, keyed by name
  sharded/                           SHARDED_STATE_DICT: the writing backend's own per-rank files
  rng/rank_XXXXX.pt                  each rank's RNG states (backends that draw random numbers)
A FULL checkpoint resumes on every backend at any world size; a SHARDED one on the backends that read the
format it was written in (`SHARDED_FORMATS`).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

from portable_fsdp import faults
from portable_fsdp.errors import UserError

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SHARDED = "sharded"
# --backend -> the format of its SHARDED_STATE_DICT files: a sharded checkpoint resumes where the format is read.
SHARDED_FORMATS = {"cpu": "torch.distributed.checkpoint", "cuda": "torch.distributed.checkpoint",
                   "xla": "torch_xla shard files"}


def rng_file(checkpoint: pathlib.Path, rank: int) -> pathlib.Path:
    return pathlib.Path(checkpoint) / "rng" / f"rank_{rank:05d}.pt"


def stored_layout(checkpoint: pathlib.Path) -> str:
    """FULL_STATE_DICT or SHARDED_STATE_DICT, from what the directory holds."""
    checkpoint = pathlib.Path(checkpoint)
    if (checkpoint / WEIGHTS).exists() or any(checkpoint.glob("*.safetensors")):  # save_pretrained may split
        return "FULL_STATE_DICT"
    if (checkpoint / SHARDED).is_dir():
        return "SHARDED_STATE_DICT"
    raise UserError("train.resume", f"{checkpoint} holds neither {WEIGHTS} nor {SHARDED}/; it is not a checkpoint")


def root(workdir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(workdir) / "checkpoints"


def staging_dir(workdir: pathlib.Path, step: int) -> pathlib.Path:
    return root(workdir) / f".tmp-step_{step:08d}"


def prepare_staging(workdir: pathlib.Path, step: int) -> pathlib.Path:
    """Rank 0 only: a fresh, empty staging directory (leftovers of crashed saves are discarded)."""
    staging = staging_dir(workdir, step)
    for leftover in root(workdir).glob(".tmp-step_*"):
        shutil.rmtree(leftover)
    staging.mkdir(parents=True)
    return staging


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(workdir: pathlib.Path, step: int, info: dict, keep_last_n: int) -> pathlib.Path:
    """Rank 0 only, after every rank has finished writing into the staging directory."""
    staging = staging_dir(workdir, step)
    write_manifest(staging, {**info, "step": step})
    faults.check("commit.manifest", 0, step)
    final = root(workdir) / f"step_{step:08d}"
    if final.exists():  # this step is already saved and complete: keep it, never replace a valid one
        shutil.rmtree(staging)
        return final
    os.rename(staging, final)
    _fsync(root(workdir))
    faults.check("commit.renamed", 0, step)
    _point_latest(workdir, final.name)
    _prune(workdir, keep_last_n)
    return final


def write_manifest(directory: pathlib.Path, info: dict) -> None:
    """fsync every file, then write manifest.json (sizes and sha256 of each) last."""
    files = sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file() and p.name != MANIFEST)
    for path in files:
        _fsync(path)
    listing = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (pathlib.Path(directory) / MANIFEST).write_text(json.dumps({**info, "files": listing}, indent=1))
    _fsync(pathlib.Path(directory) / MANIFEST)


def _point_latest(workdir: pathlib.Path, name: str) -> None:
    pointer = root(workdir) / "latest"
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, pointer)
    _fsync(root(workdir))


def _prune(workdir: pathlib.Path, keep_last_n: int) -> None:
    """Remove all but the newest `keep_last_n` complete checkpoints — never the one marked best."""
    complete = sorted(p for p in root(workdir).glob("step_*") if (p / MANIFEST).exists())
    keep = best(workdir)
    for old in complete[:-keep_last_n]:
        if old != keep:
            shutil.rmtree(old)


def mark_best(workdir: pathlib.Path, checkpoint: pathlib.Path, record: dict) -> None:
    """Rank 0 only: remember the checkpoint with the best eval_loss (pruning spares it). `record`
    (eval_loss, step, evals without improvement) lets a resumed run go on comparing against it."""
    pointer = root(workdir) / "best"
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(json.dumps({"checkpoint": pathlib.Path(checkpoint).name, **record}) + "\n")
    _fsync(tmp)
    os.replace(tmp, pointer)


def best_record(workdir: pathlib.Path) -> dict | None:
    pointer = root(workdir) / "best"
    return json.loads(pointer.read_text()) if pointer.exists() else None


def best(workdir: pathlib.Path) -> pathlib.Path | None:
    record = best_record(workdir)
    return root(workdir) / record["checkpoint"] if record else None


def latest(workdir: pathlib.Path) -> pathlib.Path | None:
    pointer = root(workdir) / "latest"
    if not pointer.exists():
        return None
    path = root(workdir) / pointer.read_text().strip()
    if not (path / MANIFEST).exists():
        raise UserError("train.resume", f"{pointer} names {path.name}, which has no {MANIFEST}; "
                        "remove the pointer or resume from another workdir")
    return path


def read_manifest(path: pathlib.Path) -> dict:
    return json.loads((pathlib.Path(path) / MANIFEST).read_text())


def verify(path: pathlib.Path) -> dict:
    """Check every file the manifest lists (size and sha256) before anything is loaded; returns the manifest."""
    path = pathlib.Path(path)
    try:
        manifest = read_manifest(path)
    except (OSError, json.JSONDecodeError):
        raise UserError("train.resume", f"{path / MANIFEST} is missing or unreadable; resume from another checkpoint") from None
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise UserError("train.resume", f"{file} is missing; the checkpoint is incomplete — resume from another one")
        if file.stat().st_size != expected["bytes"] or _sha256(file) != expected["sha256"]:
            raise UserError("train.resume", f"{file} does not match its checksum in {MANIFEST} (corrupt or "
                            "truncated); resume from another checkpoint")
    return manifest


MODEL_FIELDS_THAT_SHAPE_WEIGHTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "init_from",
                                   "architecture", "config_from")


def check_compatible(manifest: dict, config, backend_name: str) -> None:
    """A checkpoint loads under another plan or world size (that is resharding), not into another model; a
    SHARDED one only on a backend that reads its format."""
    saved = manifest.get("config", {}).get("model", {})
    differing = [f"model.{name} {saved[name]!r} -> {config.model[name]!r}"
                 for name in MODEL_FIELDS_THAT_SHAPE_WEIGHTS if name in saved and saved[name] != config.model[name]]
    if differing:
        raise UserError("train.resume", (f"the checkpoint was written for another model ({'; '.join(differing)}); "
                                         "use the model config it was trained with, or a new --workdir"))
    written_by = manifest.get("backend")
    if (manifest.get("state_dict_type") == "SHARDED_STATE_DICT"
            and SHARDED_FORMATS.get(written_by) != SHARDED_FORMATS.get(backend_name)):
        raise UserError("train.resume", (
            f"the checkpoint is a SHARDED_STATE_DICT of --backend {written_by}, which --backend {backend_name} "
            f"cannot read; resume it with --backend {written_by}, or save with plan.state_dict_type="
            "FULL_STATE_DICT, which every backend loads"))


def restores_rng(manifest: dict, backend_name: str, world_size: int) -> bool:
    """Whether a resume restores the saved RNG states, on every backend that saves them: only into the same
    backend at the same world size, where rank r's saved stream is the one rank r would have drawn. Elsewhere
    each rank starts the fresh stream `resume_seed` gives (a bit-exact resume is promised only there)."""
    return manifest.get("backend") == backend_name and manifest.get("world_size") == world_size


def resume_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of `rank` resuming at `step` when the saved RNG is not restored: deterministic, distinct per
    rank and per resume point."""
    return seed + step * 1000 + rank
