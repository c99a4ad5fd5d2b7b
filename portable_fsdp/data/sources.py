"""Where text comes from: the bundled corpus, a local text file, a local `datasets` file/directory, or (online, or
already in the Hugging Face cache) a hub dataset `org/name`.

`resolve_source` checks the source and names it without importing `datasets`; `open_dataset` reads it as a
`datasets.Dataset` (tokenised once into the token cache, portable_fsdp/data/cache.py) or, with data.streaming, an
`IterableDataset`; `read_documents` reads a small corpus into memory.
"""
from __future__ import annotations

import codecs
import dataclasses
import gzip
import os
import pathlib
import re

from portable_fsdp.errors import UserError

BUNDLED = pathlib.Path(__file__).parent / "corpus" / "python_docstrings.txt.gz"
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
TEXT_SUFFIXES = (".txt", ".md", "")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 8 << 20  # text files are read this many bytes at a time


class BadRow(Exception):
    """A row that cannot be tokenised: `row` (0-based, in the source's order) and what is wrong with it. Plain
    arguments, so that it crosses from a `datasets.map` worker process intact."""

    def __init__(self, row: int, problem: str):
        super().__init__(row, problem)
        self.row, self.problem = row, problem


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # bundled | text | file | saved | hub
    location: str  # "bundled", a resolved path, or a hub id
    column: str  # the column holding each row's text (or conversation)
    chat: bool = False  # rows are conversations (data.format=chat)
    builder: str = ""  # kind=file: the `datasets` builder (json, csv, parquet)
    name: str = ""  # kind=hub: the dataset's configuration
    split: str = "train"
    revision: str = ""

    @property
    def local(self) -> bool:
        return self.kind != "hub"

    def describe(self) -> str:
        if self.kind == "hub":
            extra = "".join(f", {k} {v}" for k, v in (("config", self.name), ("split", self.split),
                                                       ("revision", self.revision)) if v)
            return f"hub dataset {self.location} ({extra[2:]})" if extra else f"hub dataset {self.location}"
        return self.location

    def identity(self) -> dict:
        """What decides the rows: local files by path, size and modification time; a hub dataset by name, config,
        split and revision (the commit, when the hub can be asked)."""
        if self.kind == "hub":
            return {"hub": self.location, "name": self.name, "split": self.split,
                    "revision": _hub_commit(self.location, self.revision) or self.revision or "main"}
        path = BUNDLED if self.kind == "bundled" else pathlib.Path(self.location)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return {"kind": self.kind, "column": self.column,
                "files": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def resolve_source(data_cfg) -> Source:
    """data.source (and data.name / split / revision / text_column / messages_column) as a Source, checked."""
    chat = data_cfg.format == "chat"
    column = data_cfg.messages_column if chat else data_cfg.text_column
    source = data_cfg.source
    if source == "bundled":
        _text_only(data_cfg, "the bundled corpus")
        return Source("bundled", "bundled", "text")
    path = pathlib.Path(source)
    if not path.exists():
        if HUB_ID.match(source) and not source.startswith("."):
            return Source("hub", source, column, chat, name=data_cfg.name, split=data_cfg.split,
                          revision=data_cfg.revision)
        raise UserError("data.source", f"no such file or directory {source}; use 'bundled' or a local path")
    path = path.resolve()
    if path.is_dir():
        return Source("saved", str(path), column, chat, split=data_cfg.split)
    if path.suffix in TEXT_SUFFIXES:
        _text_only(data_cfg, f"a text file ({path.name})")
        return Source("text", str(path), "text")
    if path.suffix in DATASET_BUILDERS:
        return Source("file", str(path), column, chat, builder=DATASET_BUILDERS[path.suffix])
    raise UserError("data.source", (
        f"cannot read {path.name}: use .txt, .json, .jsonl, .csv, .parquet, a save_to_disk directory or a hub id"))


def _text_only(data_cfg, what: str) -> None:
    if data_cfg.format == "chat":
        raise UserError("data.format", (f"chat needs rows with a {data_cfg.messages_column!r} column of messages; "
                                        f"{what} is plain text: use a .jsonl/.parquet file, a saved dataset or a hub "
                                        "dataset, or data.format=text"))


# ---------------------------------------------------------------- plain text

def iter_bundled():
    """Docstrings of CPython's standard library (PSF license), one document per form feed."""
    with gzip.open(BUNDLED, "rt", encoding="utf-8") as f:
        yield from f.read().split("\f")


def iter_text_file(path: str):
    """The documents of a text file: the pieces between blank lines ("\\n\\n"), those that are not only whitespace
    — the same as text.split("\\n\\n"), read a chunk at a time. Bytes that are not UTF-8 stop it with a UserError
    naming the file and the line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, offset, lines = "", 0, 1
    with open(path, "rb") as f:
        while True:
            raw = f.read(_CHUNK)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:  # err.object: the bytes held back from the last chunk, then `raw`
                line = lines + err.object[:err.start].count(b"\n")
                at = offset - (len(err.object) - len(raw)) + err.start
                raise UserError("data.source", (
                    f"{path} line {line}: byte 0x{err.object[err.start]:02x} (offset {at}) is not UTF-8 text; "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")) from None
            offset += len(raw)
            lines += raw.count(b"\n")
            pieces = (carry + text).split("\n\n")
            carry = pieces.pop()
            yield from (piece for piece in pieces if piece.strip())
            if not raw:
                break
    if carry.strip():
        yield carry


def _documents_generator(kind: str, location: str):
    """For Dataset.from_generator: rows {"text": document}."""
    for doc in iter_bundled() if kind == "bundled" else iter_text_file(location):
        yield {"text": doc}


# ---------------------------------------------------------------- datasets

def open_dataset(src: Source, streaming: bool = False, work_dir: pathlib.Path | None = None):
    """`src` as a `datasets.Dataset` (built under `work_dir` when it must be converted to Arrow first) or, streaming,
    an `IterableDataset`; its column `src.column` checked to exist."""
    datasets = import_datasets(src)
    cache = str(work_dir) if work_dir else None
    try:
        if src.kind in ("bundled", "text"):
            features = datasets.Features({"text": datasets.Value("string")})
            kwargs = {"kind": src.kind, "location": src.location}
            if streaming:
                dataset = datasets.IterableDataset.from_generator(_documents_generator, features=features,
                                                                  gen_kwargs=kwargs)
            elif next(_documents_generator(**kwargs), None) is None:  # from_generator refuses to build no rows
                dataset = datasets.Dataset.from_dict({"text": []}, features=features)
            else:
                dataset = datasets.Dataset.from_generator(_documents_generator, features=features, gen_kwargs=kwargs,
                                                          cache_dir=cache)
        elif src.kind == "saved":
            dataset = _load_saved(datasets, src)
            if streaming:
                dataset = dataset.to_iterable_dataset()
        elif src.kind == "file":
            dataset = datasets.load_dataset(src.builder, data_files=src.location, split="train", streaming=streaming,
                                            cache_dir=cache)
        else:
            dataset = _load_hub(datasets, src, streaming)
    except UserError:
        raise
    except Exception as err:  # a file the builder cannot parse: one line naming it
        raise source_error(src, err) from None
    columns = dataset.column_names
    if columns is None and streaming:  # a streamed file's columns are known once a row is read
        columns = list(next(iter(dataset), {}).keys())
    if src.column not in columns:
        field = "data.messages_column" if src.chat else "data.text_column"
        raise UserError(field, f"{src.column!r} is not a column of {src.describe()} (columns: {columns})")
    return dataset


def import_datasets(src: Source | None = None):
    """`datasets`, kept off the network for local sources (a hub source may download)."""
    if src is None or src.local:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    return datasets


def _load_saved(datasets, src: Source):
    path = pathlib.Path(src.location)
    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise UserError("data.source", f"{path} is not a dataset saved with save_to_disk") from None
    if isinstance(dataset, datasets.DatasetDict):
        if src.split not in dataset:
            raise UserError("data.source", f"{path} holds splits {list(dataset)} but no {src.split!r} split "
                            "(data.split)")
        dataset = dataset[src.split]
    return dataset


def _load_hub(datasets, src: Source, streaming: bool):
    try:
        return datasets.load_dataset(src.location, src.name or None, split=src.split, revision=src.revision or None,
                                     streaming=streaming)
    except (ConnectionError, OSError) as err:
        from huggingface_hub import constants

        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else str(err).splitlines()[0]
        call = ", ".join(repr(a) for a in (src.location, src.name) if a)
        raise UserError("data.source", (
            f"{src.describe()} is not in the local Hugging Face cache and could not be downloaded ({reason}); "
            f"download it where there is a network — datasets.load_dataset({call}, split={src.split!r}) fills "
            "the cache under HF_HOME — or save_to_disk it there and set data.source to that directory")) from None


def _hub_commit(repo: str, revision: str) -> str:
    """The commit a hub revision names now, or "" offline."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return ""
    try:
        return HfApi().dataset_info(repo, revision=revision or None).sha or ""
    except Exception:  # unreachable: the download says why
        return ""


def source_error(src: Source, err: Exception) -> UserError:
    """A reader's exception as one line naming the file, and the line or row where it knows it."""
    cause = err
    while cause.__cause__ is not None and type(cause).__name__ == "DatasetGenerationError":
        cause = cause.__cause__
    if isinstance(cause, UnicodeDecodeError) and src.kind in ("file", "text"):
        line = first_undecodable_line(src.location)
        where = f" line {line[0]}: byte 0x{line[1]:02x}" if line else ""
        return UserError("data.source", f"{src.location}{where} is not UTF-8 text; re-encode the file as UTF-8")
    message = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return UserError("data.source", f"cannot read {src.describe()}: {message}")


def first_undecodable_line(path: str):
    """(line number, the first bad byte) of the first line of `path` that is not UTF-8, or None."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return number, raw[err.start]
    return None


# ---------------------------------------------------------------- small corpora, in memory

def read_documents(source: str, text_column: str) -> list:
    """Every document of a local source, in memory (the token cache reads the same rows through `datasets`)."""
    if source == "bundled":
        return list(iter_bundled())
    path = pathlib.Path(source)
    if not path.exists():
        raise UserError("data.source", f"no such file or directory {source}; use 'bundled' or a local path")
    if path.is_file() and path.suffix in TEXT_SUFFIXES:
        return list(iter_text_file(str(path)))
    if path.is_file() and path.suffix not in DATASET_BUILDERS:
        raise UserError("data.source", (
            f"cannot read {path.name}: use .txt, .json, .jsonl, .csv, .parquet or a save_to_disk directory"))
    kind = "saved" if path.is_dir() else "file"
    src = Source(kind, str(path), text_column, builder=DATASET_BUILDERS.get(path.suffix, ""))
    return [text for text in open_dataset(src)[text_column] if text]
