"""The on-disk checkpoint layout every backend shares, and how a save is made atomic.

<workdir>/checkpoints/step_00000100/   one complete checkpoint (manifest.json written last)
<workdir>/checkpoints/latest          the name of the newest complete one
A save writes into `.tmp-step_…`, then renames: a crash at any moment leaves the previous checkpoint and `latest`
untouched. Each rank fsyncs and checksums the files it wrote as it writes them (in parallel) and leaves
`.reports/rank_XXXXX.json` ({path: bytes, XXH3-128 (per 64 MiB block of a larger file: portable_fsdp.checkpoint.checksums)});
rank 0 gathers the reports into manifest.json, written last. On resume each rank checks the sizes of every file, then
the checksums of its share (a 1/world_size of the bytes, blocks of one large file spread over the ranks) while the
checkpoint loads into memory; training starts only once every share matched.
Waits around a save or a verification are bounded by `io_timeout_s`: train.collective_timeout_s plus the bytes at a
conservative IO_BYTES_PER_S, so a 70B model's hundreds of GB never run into a fixed timeout.

Inside a checkpoint, the same on every backend (which process writes which: portable_fsdp.checkpoint.files):
  model.safetensors + config.json    FULL_STATE_DICT: what `from_pretrained` loads (transformers names); split
                                     into model-0000i-of-0000N.safetensors + model.safetensors.index.json above
                                     train.max_shard_size (safetensors_shards), in train.save_dtype
  generation_config.json, tokenizer  so that pipeline("text-generation", model=<dir>) runs (data.tokenizer's)
  optimizer.pt                       FULL_STATE_DICT: torch's full optimizer state dict, keyed by name
  sharded/                           SHARDED_STATE_DICT: the writing backend's own per-rank files
  rng/rank_XXXXX.pt                  each rank's RNG states (backends that draw random numbers)
  adapter_model.safetensors +        model.peft runs (cpu/cuda), both layouts: the adapters alone, in peft's
  adapter_config.json                files, instead of model.safetensors; the manifest's `base_weights` names
                                     where the frozen base is rebuilt from on resume
<workdir>/export/ (train.export_full_at_end, SHARDED or model.peft runs): a FULL checkpoint's weights (adapters
merged in), configs and tokenizer without optimizer.pt or rng/, written into `.tmp-export` and renamed, with its
manifest.json.
A FULL checkpoint resumes on every backend at any world size; a SHARDED one on the backends that read the
format it was written in (`Backend.sharded_format`).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import threading
import time

from portable_fsdp import backends

from portable_fsdp.checkpoint import checksums, safetensors_shards

from portable_fsdp.training import faults
from portable_fsdp.errors import UserError

MANIFEST = "manifest.json"
WEIGHTS = safetensors_shards.SINGLE
REPORTS = ".reports"
# A disk (or network filesystem) rate every real one exceeds: waits on writing or hashing N bytes allow N / this.
IO_BYTES_PER_S = 100e6
OPTIMIZER = "optimizer.pt"
SHARDED = "sharded"


def rng_file(checkpoint: pathlib.Path, rank: int) -> pathlib.Path:
    return pathlib.Path(checkpoint) / "rng" / f"rank_{rank:05d}.pt"


def stored_layout(checkpoint: pathlib.Path) -> str:
    """FULL_STATE_DICT or SHARDED_STATE_DICT, from what the directory holds."""
    checkpoint = pathlib.Path(checkpoint)
    if (checkpoint / WEIGHTS).exists():
        return "FULL_STATE_DICT"
    if (checkpoint / SHARDED).is_dir():  # beside it, a model.peft run's adapters in peft's safetensors file
        return "SHARDED_STATE_DICT"
    if any(checkpoint.glob("*.safetensors")):  # save_pretrained may split; a model.peft run's adapters
        return "FULL_STATE_DICT"
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


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(path: pathlib.Path) -> dict:
    """fsync a file this rank just wrote and checksum it (it is still in this host's page cache): its manifest
    entry (portable_fsdp.checkpoint.checksums)."""
    _fsync(path)
    return checksums.of_file(path)


class HashingWriter:
    """A file opened for writing that checksums the bytes on their way (`torch.save(obj, writer)`, or dcp's file
    writer's stream): the digest of what a rank writes without reading it back. `digest` (its manifest entry) is
    set once it is closed (fsynced)."""

    def __init__(self, path: pathlib.Path):
        self.path, self.digest = pathlib.Path(path), None
        self._file, self._checksum = open(path, "wb"), checksums.Checksum()

    # hashed then written a piece at a time, each still in the core's cache when it is written: the bytes cross
    # the memory bus once, not twice (a background save shares it with the training step)
    PIECE = 2**20

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, self.PIECE):
            piece = view[start: start + self.PIECE]
            self._checksum.update(piece)
            self._file.write(piece)
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self.digest = self._checksum.entry()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def io_timeout_s(nbytes: float, floor_s: float) -> float:
    """How long ranks may wait on one another around writing or hashing `nbytes` (one rank may do it all)."""
    return floor_s + nbytes / IO_BYTES_PER_S


def checkpoint_bytes(n_params: int, weight_bytes: int = 4) -> int:
    """A checkpoint's size: the weights at `weight_bytes` per parameter plus AdamW's two fp32 moments."""
    return n_params * (weight_bytes + 8)


def wait_bound_s(n_params: int, floor_s: float) -> float:
    """The bound on every wait around a save or a verification of a model of `n_params` parameters (the same
    number on every rank and in every backend, which may build a process group for it)."""
    return io_timeout_s(checkpoint_bytes(n_params), floor_s)


def write_report(staging: pathlib.Path, rank: int, files: dict) -> None:
    """Every rank, after writing: {path: its checksums.Checksum entry, or None (checksummed here)} of the files it
    wrote, as `.reports/rank_XXXXX.json` in the staging directory (for rank 0's commit)."""
    staging = pathlib.Path(staging)
    listing = {str(pathlib.Path(p).relative_to(staging)): (d or digest(p)) for p, d in files.items()}
    reports = staging / REPORTS
    reports.mkdir(exist_ok=True)
    tmp = reports / f"rank_{rank:05d}.tmp"
    tmp.write_text(json.dumps(listing))
    os.replace(tmp, reports / f"rank_{rank:05d}.json")


def wait_for_reports(staging: pathlib.Path, count: int, timeout_s: float) -> None:
    """Rank 0 of an asynchronous save (portable_fsdp/checkpoint/async_save.py): until `count` ranks have reported."""
    reports, deadline = pathlib.Path(staging) / REPORTS, time.monotonic() + timeout_s
    while True:
        have = {p.name for p in reports.glob("rank_*.json")} if reports.is_dir() else set()
        if len(have) >= count:
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(count) if f"rank_{r:05d}.json" not in have]
            raise TimeoutError(f"rank(s) {missing} did not finish writing {staging} within {timeout_s:.0f} s")
        time.sleep(0.05)


def _gathered_listing(staging: pathlib.Path, elsewhere: dict | None = None) -> dict:
    """The ranks' reports merged (with `elsewhere`: those of ranks on other machines), plus any file here no rank
    reported (checksummed here); the reports removed."""
    listing: dict = dict(elsewhere or {})
    reports = staging / REPORTS
    for report in sorted(reports.glob("rank_*.json")) if reports.is_dir() else []:
        listing.update(json.loads(report.read_text()))
    shutil.rmtree(reports, ignore_errors=True)
    for path in sorted(p for p in staging.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = str(path.relative_to(staging))
        if name not in listing:
            listing[name] = digest(path)
    return dict(sorted(listing.items()))


def commit(workdir: pathlib.Path, step: int, info: dict, keep_last_n: int, elsewhere: dict | None = None
           ) -> pathlib.Path:
    """Rank 0 only, after every rank has finished writing (and reporting) into the staging directory; `elsewhere`:
    the reports of ranks whose files are on other machines (portable_fsdp/storage/sync.py), listed too."""
    staging = staging_dir(workdir, step)
    _write_manifest_file(staging, {**info, "step": step}, _gathered_listing(staging, elsewhere))
    faults.check("commit.manifest", 0, step)
    final = root(workdir) / f"step_{step:08d}"
    if final.exists():  # this step is already saved and complete: keep it, never replace a valid one
        shutil.rmtree(staging)
        return final
    os.rename(staging, final)
    _fsync(root(workdir))
    faults.check("commit.renamed", 0, step)
    point_latest(workdir, final.name)
    _prune(workdir, keep_last_n)
    return final


EXPORT = "export"


def export_staging(workdir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(workdir) / f".tmp-{EXPORT}"


def commit_export(workdir: pathlib.Path, info: dict, elsewhere: dict | None = None) -> pathlib.Path:
    """Rank 0 only, once every rank has written and reported its files into `export_staging`: the manifest (listing
    `elsewhere`'s files too, as `commit`), then the rename to <workdir>/export (an earlier export moved aside first,
    removed after)."""
    staging, final = export_staging(workdir), pathlib.Path(workdir) / EXPORT
    _write_manifest_file(staging, info, _gathered_listing(staging, elsewhere))
    old = final.with_name(f".old-{EXPORT}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(staging, final)
    _fsync(pathlib.Path(workdir))
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_manifest(directory: pathlib.Path, info: dict) -> None:
    """One process wrote `directory` (the offline converter): fsync and checksum every file, then manifest.json."""
    directory = pathlib.Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    _write_manifest_file(directory, info, {str(p.relative_to(directory)): digest(p) for p in files})


def _write_manifest_file(directory: pathlib.Path, info: dict, listing: dict) -> None:
    (pathlib.Path(directory) / MANIFEST).write_text(json.dumps({**info, "files": listing}, indent=1))
    _fsync(pathlib.Path(directory) / MANIFEST)


def point_latest(workdir: pathlib.Path, name: str) -> None:
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


def verify(path: pathlib.Path, rank: int = 0, world_size: int = 1) -> dict:
    """Every file the manifest lists is there with its size, and this rank's share of the bytes (`verify_share`;
    all of them with one process) matches its checksums. Returns the manifest."""
    manifest = verify_sizes(path)
    verify_checksums(path, manifest, rank, world_size)
    return manifest


def verify_checksums(path: pathlib.Path, manifest: dict, rank: int = 0, world_size: int = 1,
                     stop: threading.Event | None = None) -> None:
    """This rank's share of the bytes against their checksums: raises on the first piece that differs. `stop`
    ends it early, between pieces (a resume whose load failed stops its verification in the background)."""
    path = pathlib.Path(path)
    for piece, matches in checksums.matching(path, verify_share(manifest, rank, world_size)):
        if not matches:
            raise _mismatch(path / piece.name)
        if stop is not None and stop.is_set():
            return


def verify_sizes(path: pathlib.Path) -> dict:
    """The checks that read no file's bytes (the launcher's, before any worker starts): the manifest, and every
    file it lists there with its size. Returns the manifest."""
    path = pathlib.Path(path)
    try:
        manifest = read_manifest(path)
    except (OSError, json.JSONDecodeError):
        raise UserError("train.resume", f"{path / MANIFEST} is missing or unreadable; resume from another checkpoint") from None
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise UserError("train.resume", f"{file} is missing; the checkpoint is incomplete — resume from another one")
        if file.stat().st_size != expected["bytes"]:
            raise _mismatch(file)
        try:
            checksums.pieces(name, expected)
        except ValueError as err:
            raise UserError("train.resume", f"{path / MANIFEST}: {err}; resume from another checkpoint") from None
    return manifest


def _mismatch(file: pathlib.Path) -> UserError:
    return UserError("train.resume", f"{file} does not match its checksum in {MANIFEST} (corrupt or truncated); "
                     "resume from another checkpoint")


def verify_share(manifest: dict, rank: int, world_size: int) -> list:
    """The pieces (checksums.Piece: whole files, blocks of large ones) `rank` checksums: every piece in file order
    (numbers in names in numeric order), cut into world_size runs of about equal bytes — a piece goes to the run
    its middle byte falls in — so every byte is checked once, each rank's share is 1/world_size of the bytes
    give or take a block or a file, and each rank reads it in one pass. A SHARDED checkpoint at the world size
    it was saved at puts rank r's own file about in run r: the file its load reads, from the page cache once the
    check has read it."""
    every = sorted((p for name, entry in manifest["files"].items() for p in checksums.pieces(name, entry)),
                   key=lambda p: (_in_numeric_order(p.name), p.offset))
    total, before, share = sum(p.length for p in every), 0, []
    for piece in every:
        if min(world_size - 1, (2 * before + piece.length) * world_size // max(2 * total, 1)) == rank:
            share.append(piece)
        before += piece.length
    return share


def _in_numeric_order(name: str) -> list:
    """A sort key: `__10_0.distcp` after `__9_0.distcp`."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]  # text, number, ...


def total_bytes(manifest: dict) -> int:
    return sum(entry["bytes"] for entry in manifest["files"].values())


MODEL_FIELDS_THAT_SHAPE_WEIGHTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "init_from",
                                   "architecture", "config_from", "peft")


def check_compatible(manifest: dict, config, backend_name: str) -> None:
    """A checkpoint loads under another plan or world size (that is resharding), not into another model; a
    SHARDED one only on a backend that reads its format."""
    saved = manifest.get("config", {}).get("model", {})
    current = {name: config.model[name].to_dict() if hasattr(config.model[name], "to_dict") else config.model[name]
               for name in MODEL_FIELDS_THAT_SHAPE_WEIGHTS}
    differing = [f"model.{name} {saved[name]!r} -> {current[name]!r}"
                 for name in MODEL_FIELDS_THAT_SHAPE_WEIGHTS if name in saved and saved[name] != current[name]]
    saved_seed = manifest.get("config", {}).get("seed")
    if "base_weights" in manifest and not config.model.init_from and saved_seed != config.seed:
        differing.append(f"seed {saved_seed!r} -> {config.seed!r} (the frozen base of the adapters is its random init)")
    if differing:
        raise UserError("train.resume", (f"the checkpoint was written for another model ({'; '.join(differing)}); "
                                         "use the model config it was trained with, or a new --workdir"))
    written_by = manifest.get("backend")
    if manifest.get("state_dict_type") == "SHARDED_STATE_DICT" and _sharded_format(written_by) != _sharded_format(
            backend_name):
        raise UserError("train.resume", (
            f"the checkpoint is a SHARDED_STATE_DICT of --backend {written_by}, which --backend {backend_name} "
            f"cannot read; resume it with --backend {written_by}, or save with plan.state_dict_type="
            "FULL_STATE_DICT, which every backend loads"))


def _sharded_format(backend_name) -> str | None:
    """What a backend's SHARDED files are (`Backend.sharded_format`); None for a name no backend has."""
    return backends.load(backend_name).sharded_format() if backend_name in backends.BACKENDS else None


def restores_rng(manifest: dict, backend_name: str, world_size: int) -> bool:
    """Whether a resume restores the saved RNG states, on every backend that saves them: only into the same
    backend at the same world size, where rank r's saved stream is the one rank r would have drawn. Elsewhere
    each rank starts the fresh stream `resume_seed` gives (a bit-exact resume is promised only there)."""
    return manifest.get("backend") == backend_name and manifest.get("world_size") == world_size


def resume_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of `rank` resuming at `step` when the saved RNG is not restored: deterministic, distinct per
    rank and per resume point."""
    return seed + step * 1000 + rank
