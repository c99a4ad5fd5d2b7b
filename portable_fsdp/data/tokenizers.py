"""Tokenizers that need no download: bytes, or a local Hugging Face tokenizer directory."""
from __future__ import annotations

import pathlib

import numpy as np

from portable_fsdp.errors import UserError


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; the end-of-document marker follows them."""

    eos_token_id = 256
    vocab_size = 257

    def encode_documents(self, documents) -> np.ndarray:
        pieces = []
        for doc in documents:
            pieces.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int32))
            pieces.append(np.array([self.eos_token_id], dtype=np.int32))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class LocalHFTokenizer:
    """A tokenizer saved with `save_pretrained`, read with `AutoTokenizer.from_pretrained` offline."""

    def __init__(self, directory: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as err:
            raise UserError("data.tokenizer", f"cannot load a tokenizer from {directory} ({str(err).splitlines()[0]})") from None
        if self._tok.eos_token_id is None:
            raise UserError("data.tokenizer", f"the tokenizer in {directory} has no eos token; set one and save it again")
        self.eos_token_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    def encode_documents(self, documents) -> np.ndarray:
        documents = list(documents)
        if not documents:
            return np.zeros(0, dtype=np.int32)
        ids = self._tok(documents, add_special_tokens=False)["input_ids"]
        return np.concatenate([np.array(doc + [self.eos_token_id], dtype=np.int32) for doc in ids])


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    if not pathlib.Path(spec).is_dir():
        raise UserError("data.tokenizer", f"must be 'byte' or a local tokenizer directory (no directory {spec})")
    return LocalHFTokenizer(spec)
