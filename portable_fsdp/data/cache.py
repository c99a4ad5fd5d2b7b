"""The token cache: a source tokenised once, then memory-mapped by every process that trains on it.

`<root>/<source name>-<key>/` holds `tokens.bin` — every document's ids and its end-of-document id, one flat
stream in corpus order, uint16 (uint32 for a vocabulary over 65,536) —, `loss_mask.bin` for chat data (uint8,
1 = an assistant token) and `meta.json` (what was tokenised, with which tokenizer, how many tokens). The loader
cuts sequences out of the stream as views (portable_fsdp/data/loader.py), so memory does not grow with the
corpus, and one cache serves every data.seq_len, eval_fraction and document_masking.

The key hashes the source's identity (local files: path, size, modification time; a hub dataset: name, config,
split, revision), the tokenizer (`byte` or its directory), data.format and the column. `meta.json` also stores
the tokenizer files' sha256: a tokenizer changed in place is refused, never mixed with the ids of its past self.

The root is data.cache_dir, else $PORTABLE_FSDP_DATA_CACHE, else $XDG_CACHE_HOME/portable_fsdp/data (default
~/.cache/portable_fsdp/data): outside any workdir, so that runs (and seq_len sweeps) share one tokenisation.

Node-local rank 0 (LOCAL_RANK 0, or a process of its own) builds a missing cache with `Dataset.map(batched=True,
num_proc=data.num_proc)` into a temporary directory that is renamed into place once complete, so no reader ever
sees half a cache (on a shared disk, the first rename wins and the others discard theirs); an flock keeps two runs
on one machine from building the same cache at once. The other local ranks wait while the builder's heartbeat
file moves, and stop with one line naming themselves and the cache after `wait_s` seconds without one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import sys
import threading
import time

import numpy as np

from portable_fsdp.machine import host_cores
from portable_fsdp.data.sources import BadRow, Source, open_dataset
from portable_fsdp.errors import UserError

VERSION = 1
META, TOKENS, LOSS_MASK = "meta.json", "tokens.bin", "loss_mask.bin"
HEARTBEAT_S = 2.0
ROWS_PER_PROCESS = 2000  # fewer rows per worker process than this and one process tokenises faster


@dataclasses.dataclass(frozen=True)
class TokenStream:
    tokens: np.ndarray  # [n_tokens], memory-mapped, read-only
    loss_mask: np.ndarray | None  # [n_tokens] uint8 for chat data, else None
    meta: dict
    path: pathlib.Path


def cache_root(data_cfg) -> pathlib.Path:
    if data_cfg.cache_dir:
        return pathlib.Path(data_cfg.cache_dir).expanduser()
    if os.environ.get("PORTABLE_FSDP_DATA_CACHE"):
        return pathlib.Path(os.environ["PORTABLE_FSDP_DATA_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "portable_fsdp" / "data"


def description(data_cfg, src: Source, tokenizer) -> dict:
    """What decides the cache's bytes (hashed into its name)."""
    return {"version": VERSION, "source": src.identity(), "column": src.column, "format": data_cfg.format,
            "tokenizer": tokenizer.spec}


def cache_path(data_cfg, src: Source, tokenizer) -> pathlib.Path:
    key = hashlib.sha256(json.dumps(description(data_cfg, src, tokenizer), sort_keys=True).encode()).hexdigest()
    name = re.sub(r"[^\w.-]+", "_", pathlib.Path(src.location).name if src.local else src.location)[-48:]
    return cache_root(data_cfg) / f"{name}-{key[:16]}"


def token_stream(data_cfg, src: Source, tokenizer, wait_s: float = 300.0) -> TokenStream:
    """The cached token stream of `src`, built first when missing (see the module's docstring)."""
    final = cache_path(data_cfg, src, tokenizer)
    if not final.is_dir():
        _ensure(final, data_cfg, src, tokenizer, wait_s)
    return open_cache(final, tokenizer)


def open_cache(path: pathlib.Path, tokenizer) -> TokenStream:
    """Memory-map a complete cache, checked: its metadata readable, its files as long as it says, its tokenizer
    the one given. Any fault is one line; nothing is deleted."""
    redo = f"delete {path} to tokenise again"
    meta_path = path / META
    if not meta_path.is_file():
        raise UserError("data.cache_dir", (f"{path} holds no {META}: it is not a complete token cache (emptied, "
                                           f"or copied in part); {redo}"))
    try:
        meta = json.loads(meta_path.read_text())
        n_tokens, dtype = int(meta["n_tokens"]), np.dtype(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError("data.cache_dir", f"{meta_path} cannot be read ({err}); {redo}") from None
    if meta.get("version") != VERSION:
        raise UserError("data.cache_dir", f"{path} was written by another version of the token cache; {redo}")
    ours = tokenizer.identity()
    if meta["tokenizer"]["identity"] != ours:
        raise UserError("data.tokenizer", (
            f"{tokenizer.spec} is not the tokenizer the token cache {path} was built with (its files' "
            f"{meta['tokenizer']['identity'][:19]} then, {ours[:19]} now): restore that tokenizer, or {redo} with "
            "this one"))
    arrays = {}
    for name, file_dtype in ((TOKENS, dtype), (LOSS_MASK, np.dtype(np.uint8))):
        if name == LOSS_MASK and not meta.get("loss_mask"):
            arrays[name] = None
            continue
        file = path / name
        expected = n_tokens * file_dtype.itemsize
        size = file.stat().st_size if file.is_file() else None
        if size != expected:
            held = "is missing" if size is None else f"holds {size:,} bytes"
            raise UserError("data.cache_dir", (f"{file} {held} where {META} says {expected:,} ({n_tokens:,} tokens): "
                                               f"the cache is damaged; {redo}"))
        arrays[name] = _mapped(file, file_dtype, n_tokens) if n_tokens else np.zeros(0, file_dtype)
    return TokenStream(arrays[TOKENS], arrays[LOSS_MASK], meta, path)


def _mapped(file: pathlib.Path, dtype: np.dtype, n: int) -> np.memmap:
    """Read-only, and read as it is used: rows are picked at random, so no read-ahead around each one (a cold cache
    would otherwise read ~128 KB from disk for every 128-token row). Pages read stay in the page cache, shared by
    the ranks of the machine and reclaimable: they are not the process's own memory."""
    import mmap

    array = np.memmap(file, dtype, mode="r", shape=(n,))
    if hasattr(mmap, "MADV_RANDOM") and getattr(array, "_mmap", None) is not None:
        array._mmap.madvise(mmap.MADV_RANDOM)
    return array


# ---------------------------------------------------------------- who builds, who waits

def _ensure(final: pathlib.Path, data_cfg, src: Source, tokenizer, wait_s: float) -> None:
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError("data.cache_dir", f"cannot create {root} ({err.strerror}); set data.cache_dir to a "
                        "writable directory") from None
    heartbeat = root / f".{final.name}.building"
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return _wait(final, heartbeat, wait_s, src)
    import fcntl

    with open(root / f".{final.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run on this machine building it: wait for it to finish
        try:
            if final.is_dir():
                return None
            for stale in root.glob(f"{final.name}.tmp-{socket.gethostname()}-*"):  # builders here hold the lock
                shutil.rmtree(stale, ignore_errors=True)
            with _beating(heartbeat):
                build(final, data_cfg, src, tokenizer)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return None


def _wait(final: pathlib.Path, heartbeat: pathlib.Path, wait_s: float, src: Source) -> None:
    began = time.monotonic()
    while not final.is_dir():
        try:
            quiet = time.time() - heartbeat.stat().st_mtime
        except FileNotFoundError:
            quiet = time.monotonic() - began
        if quiet > wait_s:
            rank, local = os.environ.get("RANK", "?"), os.environ.get("LOCAL_RANK", "?")
            raise UserError("data.cache_dir", (
                f"rank {rank} (local rank {local}) waited {wait_s:g} s for local rank 0 to tokenise "
                f"{src.describe()} into {final}, and its heartbeat {heartbeat.name} "
                f"{'never appeared' if not heartbeat.exists() else f'stopped {quiet:.0f} s ago'}; local rank 0's "
                "own error line says why (raise train.collective_timeout_s if it is only slow)"))
        time.sleep(0.2)


@contextlib.contextmanager
def _beating(path: pathlib.Path):
    """Touch `path` every HEARTBEAT_S seconds while the body runs (the waiting ranks watch it); remove it after."""
    stop = threading.Event()

    def beat():
        while True:
            path.write_text(f"{socket.gethostname()} pid {os.getpid()}\n")
            if stop.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name="token-cache-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- building

def build(final: pathlib.Path, data_cfg, src: Source, tokenizer) -> None:
    """Tokenise `src` into `final` through a temporary directory renamed into place when complete."""
    from portable_fsdp.data.rows import RowEncoder

    tmp = final.parent / f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    began = time.perf_counter()
    try:
        _quiet_datasets()
        dataset = open_dataset(src, work_dir=tmp / "work")
        _check_text_column(dataset, src)
        processes = _processes(data_cfg.num_proc, len(dataset))
        print(f"data: tokenising {src.describe()} ({len(dataset):,} rows, {processes} process"
              f"{'es' if processes > 1 else ''}) into {final}", flush=True)
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
        encoder = RowEncoder(tokenizer.spec, src.column, src.chat, skip_empty=src.kind not in ("bundled", "text"),
                             id_type=dtype.name)
        # text: Arrow batches straight to the tokenizer; chat: rows decoded as `datasets` types them (lists of dicts)
        mapped = (dataset if src.chat else dataset.with_format("arrow")).map(
            encoder, batched=True, with_indices=True, remove_columns=dataset.column_names,
            num_proc=processes if processes > 1 else None, new_fingerprint=final.name,
            cache_file_name=str(tmp / "work" / "tokens.arrow"), desc="tokenising")
        n_tokens, n_documents = _write_stream(mapped, tmp, dtype, src.chat)
        del mapped, dataset
        shutil.rmtree(tmp / "work", ignore_errors=True)
        seconds = time.perf_counter() - began
        meta = {"version": VERSION, "description": description(data_cfg, src, tokenizer),
                "source": src.describe(), "n_tokens": n_tokens, "n_documents": n_documents, "dtype": dtype.name,
                "loss_mask": src.chat, "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id,
                "tokenizer": {"spec": tokenizer.spec, "identity": tokenizer.identity()},
                "built": {"host": socket.gethostname(), "pid": os.getpid(), "processes": processes,
                          "seconds": round(seconds, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
        _write_durably(tmp / META, json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # else another machine's builder renamed first: theirs serves, ours goes
                raise
        print(f"data: {n_documents:,} documents, {n_tokens:,} tokens in {seconds:.1f} s "
              f"({n_tokens / max(seconds, 1e-9):,.0f} tokens/s)", flush=True)
    except BadRow as err:
        raise UserError("data.source", f"{src.describe()}: row {err.row} {err.problem}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _processes(num_proc: int, rows: int) -> int:
    wanted = num_proc or min(host_cores.available(), 16)
    return max(1, min(wanted, rows // ROWS_PER_PROCESS))


def _quiet_datasets() -> None:
    """No progress bars off a terminal, and no log lines of its own: errors reach the user as one line."""
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.utils.logging.get_logger("datasets").setLevel("CRITICAL")
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()


def _check_text_column(dataset, src: Source) -> None:
    """A text column that `datasets` did not read as strings (numbers, or a mix): the first row that is not text."""
    if src.chat:
        return  # each conversation is checked as it is encoded
    feature = dataset.features[src.column]
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return
    from portable_fsdp.data.rows import not_text

    for start in range(0, len(dataset), 1000):
        for offset, value in enumerate(dataset[start:start + 1000][src.column]):
            if not isinstance(value, str):
                raise BadRow(start + offset, not_text(value, src.column))


def _write_stream(mapped, directory: pathlib.Path, dtype: np.dtype, chat: bool) -> tuple:
    """Append every row's ids (and loss mask) to the flat files, one Arrow chunk at a time."""
    import pyarrow.compute as pc

    table = mapped.data.table
    n_tokens = n_documents = 0
    with open(directory / TOKENS, "wb") as tokens, \
            (open(directory / LOSS_MASK, "wb") if chat else contextlib.nullcontext()) as mask:
        if "input_ids" in table.column_names:
            for chunk in table.column("input_ids").chunks:
                values = chunk.flatten().to_numpy(zero_copy_only=False)
                tokens.write(values.astype(dtype, copy=False).tobytes())
                n_tokens += len(values)
                n_documents += int(pc.sum(pc.greater(pc.list_value_length(chunk), 0)).as_py() or 0)
            for chunk in table.column("loss_mask").chunks if chat else ():
                mask.write(chunk.flatten().to_numpy(zero_copy_only=False).astype(np.uint8, copy=False).tobytes())
        for f in (tokens, mask) if chat else (tokens,):
            f.flush()
            os.fsync(f.fileno())
    return n_tokens, n_documents


def _write_durably(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
