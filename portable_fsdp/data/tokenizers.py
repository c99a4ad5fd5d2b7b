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


BYTE_EOS = "<|endoftext|>"


def byte_tokenizer_for_transformers():
    """The byte tokenizer as a transformers fast tokenizer with the same ids: byte b is id b (through GPT-2's
    byte-to-character table and no merges), id 256 the end-of-document token. Decoding gives the bytes back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters GPT-2 maps bytes to
    byte_chars = _bytes_to_unicode()
    assert set(byte_chars.values()) == set(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab[BYTE_EOS] = ByteTokenizer.eos_token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BYTE_EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=BYTE_EOS, pad_token=BYTE_EOS)


def _bytes_to_unicode() -> dict:
    """GPT-2's table: printable bytes map to themselves, the others to characters from U+0100 on."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def save_for_generation(spec: str, directory) -> dict:
    """Beside a checkpoint's model: the tokenizer of `data.tokenizer` (the byte one as an equivalent fast
    tokenizer) and a generation_config.json whose end token is the tokenizer's (the end of document the model
    learnt), so that `pipeline("text-generation", model=directory)` runs. Returns {path written: None}."""
    import json

    directory = pathlib.Path(directory)
    if spec == "byte":
        tokenizer, eos = byte_tokenizer_for_transformers(), ByteTokenizer.eos_token_id
    else:
        tokenizer = LocalHFTokenizer(spec)._tok
        eos = tokenizer.eos_token_id
    written = {pathlib.Path(p): None for p in tokenizer.save_pretrained(directory) if pathlib.Path(p).is_file()}
    path = directory / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    ends = generation.get("eos_token_id")
    if not (ends == eos or (isinstance(ends, list) and eos in ends)):
        generation["eos_token_id"] = eos
    generation.setdefault("pad_token_id", tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    if spec == "byte":
        generation.pop("bos_token_id", None)  # the byte tokenizer has none: the model never saw one
    path.write_text(json.dumps(generation, indent=2) + "\n")
    written[path] = None
    return written
