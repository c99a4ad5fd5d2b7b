"""Where text comes from: the bundled corpus, a local text file, or a local `datasets` file/directory."""
from __future__ import annotations

import gzip
import os
import pathlib

from portable_fsdp.errors import UserError

BUNDLED = pathlib.Path(__file__).parent / "corpus" / "python_docstrings.txt.gz"
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def read_documents(source: str, text_column: str) -> list:
    if source == "bundled":
        # Docstrings of CPython's standard library (PSF license), one document per form feed.
        with gzip.open(BUNDLED, "rt", encoding="utf-8") as f:
            return f.read().split("\f")
    path = pathlib.Path(source)
    if not path.exists():
        raise UserError("data.source", f"no such file or directory {source}; use 'bundled' or a local path")
    if path.is_file() and path.suffix in (".txt", ".md", ""):
        return [doc for doc in path.read_text(encoding="utf-8").split("\n\n") if doc.strip()]
    return _read_dataset(path, text_column)


def _read_dataset(path: pathlib.Path, text_column: str) -> list:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    if path.is_dir():
        try:
            dataset = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise UserError("data.source", f"{path} is not a dataset saved with save_to_disk") from None
        if isinstance(dataset, datasets.DatasetDict):
            if "train" not in dataset:
                raise UserError("data.source", f"{path} holds splits {list(dataset)} but no 'train' split")
            dataset = dataset["train"]
    elif path.suffix in DATASET_BUILDERS:
        dataset = datasets.load_dataset(DATASET_BUILDERS[path.suffix], data_files=str(path), split="train")
    else:
        raise UserError("data.source", (
            f"cannot read {path.name}: use .txt, .json, .jsonl, .csv, .parquet or a save_to_disk directory"))
    if text_column not in dataset.column_names:
        raise UserError("data.text_column", f"{text_column!r} is not a column of {path} (columns: {dataset.column_names})")
    return [text for text in dataset[text_column] if text]
