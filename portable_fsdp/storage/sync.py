"""How a local working copy and its bucket prefix (portable_fsdp.storage.remote) stay one workdir.

Checkpoints are written and committed in the local copy exactly as in a local workdir (every backend's writers
unchanged; portable_fsdp/checkpoint/layout.py); rank 0 then uploads the committed checkpoint to
<url>/checkpoints/step_N/: every file the manifest lists, then manifest.json — the commit marker, an object store
having no rename — then `best` and `latest`. A prefix without manifest.json is never resumed nor named by `latest`,
and the leftovers of an upload that was killed are removed by the next commit. Rank 0 uploads in a thread while
training goes on (portable_fsdp.checkpoint.async_save.in_background): the next save and the end of the run wait for
it, so one upload at most is in flight and no rank's bounded wait covers an upload's time.
Once a checkpoint is in the bucket the older local copies are removed (the one marked best is kept), so the local
disk holds about one checkpoint; the bucket keeps train.keep_last_n of them.

Machines that share no disk (a TPU slice's hosts, SLURM nodes, each with its own local copy; a machine is the ranks
that report into one copy's staging directory, whichever backend numbers them): rank 0's staging directory is then
missing from some rank's copy, which every rank learns through one `any_rank` (portable_fsdp/checkpoint/session.py).
Each rank writes and reports into its own machine's copy as usual; then each machine but rank 0's has its first rank
upload the files its ranks reported, then their reports, into the uncommitted <url>/checkpoints/step_N/
(`upload_machine_share`: a report there means its files are; train.export_full_at_end's export/ alike), while every
rank waits at a barrier bounded by `upload_timeout_s` (the bytes at a conservative UPLOAD_BYTES_PER_S, plus
train.collective_timeout_s). Rank 0 reads their reports from the bucket (`gather_reports`), commits locally with a
manifest that lists every file (its copy lacks the other machines' files) and uploads its own files, then the
manifest, as above. A failed upload or a missing report fails the save on every rank, the failing machine's error
and rank 0's naming the ranks. These uploads are synchronous: the manifest may be written only once every machine's
files are in the bucket, rank 0 learns that through a collective, and only the training thread runs collectives;
rank 0's own upload stays in the background, and a train.async_save write is waited for before the machines upload.
A resume downloads the whole checkpoint into every machine's copy (`_holds`: rank 0's copy holds its manifest but
not the other machines' files); fetching only the files a machine's ranks read would save that.

The trade-off against writing straight into the bucket (dcp's fsspec writer, orbax's GCS support): every backend's
writers, checksums and atomic local commit stay as they are, at the cost of one checkpoint of local disk and an
upload after the write.

A resume (`pull_latest`, before any worker starts) reads `latest` from the bucket, checks its manifest is there and
downloads the checkpoint unless the local copy holds it already (its manifest and every file listed), in every
machine's launcher; the workers then verify sizes and checksums as for any checkpoint. The run's records
(metrics.jsonl, the plot inputs, trackers' files, export/) are uploaded at each save and when the run ends
(`push_records`). Imports no framework.
"""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import shutil

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.errors import UserError
from portable_fsdp.storage.remote import MARKER, Remote
from portable_fsdp.training import faults

CHECKPOINTS = "checkpoints"
PARALLEL_TRANSFERS = 8
# A rate every training machine's link to its bucket exceeds: waits on uploading N bytes allow N / this.
UPLOAD_BYTES_PER_S = 25e6
_NOT_RECORDS = {CHECKPOINTS, MARKER, ".lock"}  # what `push_records` leaves alone
_NOT_SYNCED = (".tmp-", ".old-", ".write-test")  # half-written or passing files


def _transfer_all(transfer, items) -> None:
    with concurrent.futures.ThreadPoolExecutor(PARALLEL_TRANSFERS, thread_name_prefix="portable_fsdp-sync") as pool:
        for done in [pool.submit(transfer, *item) for item in items]:
            done.result()


def _step_of(name: str) -> int:
    return int(name.removeprefix("step_"))


def committed(remote: Remote) -> list:
    """The names of the checkpoints in the bucket that are complete (hold manifest.json), oldest first."""
    names = [n for n in remote.children(CHECKPOINTS) if n.startswith("step_")]
    return [n for n in names if checkpointing.MANIFEST in remote.children(f"{CHECKPOINTS}/{n}")]


def commit_checkpoint(remote: Remote, workdir: pathlib.Path, final: pathlib.Path, keep_last_n: int,
                      uploaded: frozenset = frozenset()) -> None:
    """Rank 0, once `final` is committed locally: upload it (but the files other machines `uploaded`),
    manifest.json last, then `best` and `latest`; remove leftovers of killed uploads, checkpoints beyond
    `keep_last_n` in the bucket and older local copies."""
    prefix, step = f"{CHECKPOINTS}/{final.name}", _step_of(final.name)
    done = committed(remote)
    for leftover in set(n for n in remote.children(CHECKPOINTS) if n.startswith("step_")) - {*done, final.name}:
        remote.remove(f"{CHECKPOINTS}/{leftover}")
    if final.name not in done:
        listed = set(checkpointing.read_manifest(final)["files"]) - uploaded
        _transfer_all(remote.put, [(final / name, f"{prefix}/{name}") for name in sorted(listed)])
        faults.check("upload.files", 0, step)
        remote.put(final / checkpointing.MANIFEST, f"{prefix}/{checkpointing.MANIFEST}")
        done.append(final.name)
    for pointer in ("best", "latest"):
        if (checkpointing.root(workdir) / pointer).exists():
            remote.put(checkpointing.root(workdir) / pointer, f"{CHECKPOINTS}/{pointer}")
    best = checkpointing.best(workdir)
    spared = {final.name, best.name if best else None}
    for old in sorted(done, key=_step_of)[:-keep_last_n] if keep_last_n else []:
        if old not in spared:
            remote.remove(f"{CHECKPOINTS}/{old}")
    for local in checkpointing.root(workdir).glob("step_*"):
        if local.name not in spared and _step_of(local.name) < step:
            shutil.rmtree(local)
    push_records(remote, workdir)


def upload_timeout_s(n_params: int, floor_s: float) -> float:
    """How long the processes wait for the other machines' uploads of a save (one machine may hold all the
    bytes): the same number on every process, as checkpointing.wait_bound_s."""
    return floor_s + checkpointing.checkpoint_bytes(n_params) / UPLOAD_BYTES_PER_S


def machine_ranks(staging: pathlib.Path) -> list:
    """The ranks that reported into this local copy's staging directory: the ranks of this machine."""
    return sorted(int(p.stem.removeprefix("rank_")) for p in (staging / checkpointing.REPORTS).glob("rank_*.json"))


def upload_machine_share(remote: Remote, staging: pathlib.Path, prefix: str) -> None:
    """A machine other than rank 0's, its first rank: the files its ranks reported into the bucket's uncommitted
    `prefix` (checkpoints/step_N, export), then their reports (a report there means its files are)."""
    reports = staging / checkpointing.REPORTS
    names = [name for rank in machine_ranks(staging) for name in json.loads(reports.joinpath(
        f"rank_{rank:05d}.json").read_text())]
    _transfer_all(remote.put, [(staging / name, f"{prefix}/{name}") for name in names])
    _transfer_all(remote.put, [(report, f"{prefix}/{checkpointing.REPORTS}/{report.name}")
                               for report in sorted(reports.glob("rank_*.json"))])


def gather_reports(remote: Remote, prefix: str, ranks: list) -> dict:
    """Rank 0, once the other machines uploaded their shares into `prefix`: the reports of `ranks`, merged
    ({path: checksum entry}) and removed from the bucket; one line naming the ranks whose report is not there."""
    reports = f"{prefix}/{checkpointing.REPORTS}"
    texts = {rank: remote.read_text(f"{reports}/rank_{rank:05d}.json") for rank in ranks}
    missing = [rank for rank, text in texts.items() if text is None]
    if missing:
        raise UserError("--workdir", f"rank(s) {missing} did not upload their part of {prefix} to "
                        f"{remote.url}/{prefix}/ (their machine's error says why); check that every machine can "
                        "write to the bucket")
    remote.remove(reports)
    return {name: entry for text in texts.values() for name, entry in json.loads(text).items()}


def pull_latest(remote: Remote, workdir: pathlib.Path) -> str | None:
    """Before any worker starts: make the local copy hold the bucket's newest complete checkpoint (and the best
    one) and point `latest` at it. Returns its name; None when the bucket holds none."""
    name = (remote.read_text(f"{CHECKPOINTS}/latest") or "").strip()
    if not name:
        return None
    best = remote.read_text(f"{CHECKPOINTS}/best")
    for wanted in {name, json.loads(best)["checkpoint"] if best else name}:
        _pull_checkpoint(remote, workdir, wanted)
    root = checkpointing.root(workdir)
    for newer in root.glob("step_*"):  # committed here by a run killed before its upload: the bucket decides
        if _step_of(newer.name) > _step_of(name):
            shutil.rmtree(newer)
    for staged in root.glob(".tmp-step_*"):  # a killed save's, on a machine where no rank 0 clears them
        shutil.rmtree(staged)
    if best:
        (root / "best").write_text(best)
    checkpointing.point_latest(workdir, name)
    return name


def _pull_checkpoint(remote: Remote, workdir: pathlib.Path, name: str) -> None:
    prefix = f"{CHECKPOINTS}/{name}"
    manifest = remote.read_text(f"{prefix}/{checkpointing.MANIFEST}")
    if manifest is None:
        raise UserError("train.resume", f"{remote.url}/{CHECKPOINTS}/latest names {name}, which has no "
                        f"{checkpointing.MANIFEST}; remove that pointer or resume from another workdir")
    local = checkpointing.root(workdir) / name
    if _holds(local, manifest):
        return  # this copy committed it (the workers verify its checksums)
    download = local.with_name(f".tmp-download-{name}")
    shutil.rmtree(download, ignore_errors=True)
    _transfer_all(remote.get, [(f"{prefix}/{file}", download / file) for file in json.loads(manifest)["files"]])
    (download / checkpointing.MANIFEST).write_text(manifest)
    shutil.rmtree(local, ignore_errors=True)
    download.rename(local)


def _holds(local: pathlib.Path, manifest: str) -> bool:
    """Whether the local copy holds the checkpoint `manifest` describes: that manifest and every file it lists at
    its size (the copy of the machine that committed it lacks the files the other machines wrote)."""
    if not (local / checkpointing.MANIFEST).is_file() or (local / checkpointing.MANIFEST).read_text() != manifest:
        return False
    return all((local / name).is_file() and (local / name).stat().st_size == entry["bytes"]
               for name, entry in json.loads(manifest)["files"].items())


def prepare(remote: Remote, workdir: pathlib.Path, resume: bool) -> None:
    """Before any worker starts: the local copy holds the checkpoint to resume from, or none (the bucket decides
    which checkpoints exist, whatever a killed run left here). A run that does not resume must not mix its
    checkpoints with those already in the bucket."""
    if not resume and remote.read_text(f"{CHECKPOINTS}/latest"):
        raise UserError("--workdir", f"{remote.url} already holds checkpoints; pass --config.train.resume=true to "
                        "continue from them, or choose a new --workdir")
    if not (resume and pull_latest(remote, workdir)):
        shutil.rmtree(checkpointing.root(workdir), ignore_errors=True)
    if resume:
        _pull_records(remote, workdir)


def _records(names) -> list:
    return [n for n in names if n.split("/")[0] not in _NOT_RECORDS and not n.split("/")[0].startswith(_NOT_SYNCED)]


def _pull_records(remote: Remote, workdir: pathlib.Path) -> None:
    """The records a resumed run appends to, when this copy lacks them (another machine, a cleared cache)."""
    missing = [n for n in _records(remote.sizes("")) if not (pathlib.Path(workdir) / n).exists()]
    _transfer_all(remote.get, [(n, pathlib.Path(workdir) / n) for n in missing])


def push_records(remote: Remote, workdir: pathlib.Path) -> None:
    """Rank 0 (at each save) and the launcher (at the end): the run's records into the bucket; an export's files
    before its manifest."""
    workdir = pathlib.Path(workdir)
    files = [workdir / n for n in _records(str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.is_file())]
    manifests = [p for p in files if p.name == checkpointing.MANIFEST]
    for manifest in manifests:  # an export being replaced is incomplete until its new manifest is there
        remote.remove(str(manifest.relative_to(workdir)))
    _transfer_all(remote.put, [(p, str(p.relative_to(workdir))) for p in files if p not in manifests])
    _transfer_all(remote.put, [(p, str(p.relative_to(workdir))) for p in manifests])
