"""Tokenizers: bytes, a local Hugging Face tokenizer directory, or a hub model's (downloaded into the Hugging Face
cache, then read as a local directory).

Each one encodes a document as its ids followed by the end-of-document id (`encode_each`), names itself
(`spec`) and fingerprints its files (`identity`, stored with a token cache so that a cache is never read with
another tokenizer's ids). A local tokenizer with a chat template also renders conversations (`encode_chats`).
"""
from __future__ import annotations

import hashlib
import pathlib

import numpy as np

from portable_fsdp.data.sources import HUB_ID
from portable_fsdp.errors import UserError

# The files that decide a tokenizer's ids (never a model's weights, which may share its directory).
_TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges*", "special_tokens_map.json", "added_tokens.json", "*.model",
                    "*.tiktoken", "chat_template*")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; the end-of-document marker follows them."""

    eos_token_id = 256
    vocab_size = 257
    spec = "byte"
    chat_template = None

    def identity(self) -> str:
        return "byte:utf-8+eos256"

    def encode_documents(self, documents) -> np.ndarray:
        pieces = self.encode_each(documents)
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)

    def encode_each(self, documents) -> list:
        """One int32 array per document: its UTF-8 bytes, then the end-of-document id."""
        out = []
        for doc in documents:
            raw = doc.encode("utf-8")
            ids = np.empty(len(raw) + 1, dtype=np.int32)
            ids[:-1] = np.frombuffer(raw, dtype=np.uint8)
            ids[-1] = self.eos_token_id
            out.append(ids)
        return out


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
        self.spec = str(pathlib.Path(directory).resolve())
        self.chat_template = getattr(self._tok, "chat_template", None)

    def identity(self) -> str:
        """sha256 over the names and bytes of the files that decide the ids."""
        directory = pathlib.Path(self.spec)
        files = sorted({p for pattern in _TOKENIZER_FILES for p in directory.glob(pattern) if p.is_file()})
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return f"sha256:{digest.hexdigest()}"

    def encode_documents(self, documents) -> np.ndarray:
        pieces = self.encode_each(list(documents))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)

    def encode_each(self, documents) -> list:
        if not documents:
            return []
        ids = self._tok(list(documents), add_special_tokens=False)["input_ids"]
        return [np.array(doc + [self.eos_token_id], dtype=np.int32) for doc in ids]

    def encode_chats(self, conversations) -> list:
        """[(ids, loss_mask)] per conversation, rendered with the tokenizer's chat template then the end-of-document
        id. loss_mask is 1 on the tokens of assistant turns (the characters the template adds when an assistant
        message follows the generation prompt, its end-of-turn marker included) and on the final end-of-document id
        after an assistant turn; 0 elsewhere. Raises ValueError when the template does not render a conversation's
        beginning as the beginning of the whole (then assistant turns cannot be located)."""
        out = []
        for messages in conversations:
            text = self._tok.apply_chat_template(messages, tokenize=False)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self._tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) \
                    if i else ""
                through = self._tok.apply_chat_template(messages[:i + 1], tokenize=False)
                if not (text.startswith(before) and text.startswith(through)):
                    raise ValueError("its chat template does not render the conversation's first turns as the "
                                     "beginning of the whole conversation, so assistant turns cannot be located")
                spans.append((len(before), len(through)))
            enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
            starts = np.array([start for start, _ in enc["offset_mapping"]], dtype=np.int64)
            mask = np.zeros(len(starts) + 1, dtype=np.uint8)
            for begin, end in spans:
                mask[:-1][(starts >= begin) & (starts < end)] = 1
            mask[-1] = bool(messages) and messages[-1]["role"] == "assistant"
            out.append((np.array(enc["input_ids"] + [self.eos_token_id], dtype=np.int32), mask))
        return out


def resolve_tokenizer(config) -> None:
    """data.tokenizer left empty: model.init_from's tokenizer when init_from names a hub model or a directory with
    tokenizer files (a directory of weights only trains on bytes), else bytes. Once, before the workers start."""
    if config.data.tokenizer:
        return
    source = config.model.init_from
    directory = pathlib.Path(source)
    has_tokenizer = any(directory.glob("tokenizer*")) if directory.is_dir() else bool(HUB_ID.match(source))
    config.data.tokenizer = source if source and has_tokenizer else "byte"


def load_tokenizer(spec: str):
    if spec in ("", "byte"):  # empty: no model.init_from to take one from
        return ByteTokenizer()
    if pathlib.Path(spec).is_dir():
        return LocalHFTokenizer(spec)
    if HUB_ID.match(spec):
        return LocalHFTokenizer(hub_tokenizer_directory(spec))
    raise UserError("data.tokenizer", f"must be 'byte', a local tokenizer directory or a hub id org/name (no directory "
                    f"{spec})")


def hub_tokenizer_directory(repo_id: str) -> str:
    """The tokenizer files of hub model `repo_id` in the Hugging Face cache (downloaded when online)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=[*_TOKENIZER_FILES, "config.json"])
    except Exception as err:  # offline, gated, missing: every one is the same fix
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError("data.tokenizer", (
            f"{repo_id} is not a local directory and its tokenizer could not be read from the Hugging Face hub "
            f"({reason}); download it where there is a network (hf download {repo_id} --local-dir DIR) and set "
            "data.tokenizer=DIR")) from None


def require_chat_template(tokenizer) -> None:
    """data.format=chat renders rows with the tokenizer's chat template: one line naming the fix when it has none."""
    if tokenizer.chat_template:
        return
    if isinstance(tokenizer, ByteTokenizer):
        raise UserError("data.tokenizer", (
            "data.format=chat renders conversations with a chat template, and the byte tokenizer has none; set "
            "data.tokenizer to a local tokenizer directory that has one (a chat_template in tokenizer_config.json "
            "or a chat_template.jinja file)"))
    raise UserError("data.tokenizer", (
        f"data.format=chat renders conversations with a chat template, and the tokenizer in {tokenizer.spec} has "
        "none; add one (tokenizer.chat_template = '...'; tokenizer.save_pretrained(DIR)) or use a tokenizer "
        "directory that has one"))


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
    own = load_tokenizer(spec)
    byte = isinstance(own, ByteTokenizer)
    tokenizer = byte_tokenizer_for_transformers() if byte else own._tok
    eos = own.eos_token_id
    written = {pathlib.Path(p): None for p in tokenizer.save_pretrained(directory) if pathlib.Path(p).is_file()}
    path = directory / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    ends = generation.get("eos_token_id")
    if not (ends == eos or (isinstance(ends, list) and eos in ends)):
        generation["eos_token_id"] = eos
    generation.setdefault("pad_token_id", tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    if byte:
        generation.pop("bos_token_id", None)  # the byte tokenizer has none: the model never saw one
    path.write_text(json.dumps(generation, indent=2) + "\n")
    written[path] = None
    return written


def load_checked_tokenizer(data_cfg, model_vocab_size: int):
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError("model.vocab_size", (
            f"{model_vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids; token ids would "
            f"index past the embedding: set model.vocab_size >= {tokenizer.vocab_size}"))
    if data_cfg.format == "chat":
        require_chat_template(tokenizer)
    return tokenizer
