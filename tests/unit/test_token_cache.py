"""The token cache (portable_fsdp/data/cache.py): the same sequences as packing in memory, built once by node-local
rank 0 while the others wait, never half-written, and every fault of the data or the cache one line."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from portable_fsdp.config.schema import base_config
from portable_fsdp.data import batch as batch_lib, cache, loader, sources
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.data.batch import EvalBatches
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.data.tokenizers import ByteTokenizer, load_tokenizer
from tests.conftest import ROOT
from tests.unit._helpers import user_error


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTABLE_FSDP_DATA_CACHE", str(tmp_path / "token_cache"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", pathlib.Path(tmp_path / "hf_cache"))


def data_cfg(source="bundled", seq_len=16, **fields):
    cfg = base_config().data
    cfg.source, cfg.seq_len = str(source), seq_len
    for name, value in fields.items():
        cfg[name] = value
    return cfg


def in_memory_sequences(documents, seq_len, tokenizer=None):
    """The packing before the token cache (every process tokenised the corpus in memory), kept as the reference."""
    tokens = (tokenizer or ByteTokenizer()).encode_documents(documents)
    n_sequences = max(0, (len(tokens) - 1) // seq_len)
    starts = np.arange(n_sequences) * seq_len
    return tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int64)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def cache_dirs(tmp_path):
    root = tmp_path / "token_cache"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


# ---------------------------------------------------------------- the same batches as before

@pytest.mark.parametrize("document_masking", [False, True])
def test_bundled_corpus_gives_the_batches_of_in_memory_packing(document_masking):
    seq_len, eval_fraction = 128, 0.05
    data = build_token_data(data_cfg(seq_len=seq_len, eval_fraction=eval_fraction), 384, min_train_sequences=8)
    old = in_memory_sequences(sources.read_documents("bundled", "text"), seq_len)
    n_eval = max(1, int(len(old) * eval_fraction))
    old_train, old_eval = old[:len(old) - n_eval], old[len(old) - n_eval:]
    np.testing.assert_array_equal(data.train, old_train)
    np.testing.assert_array_equal(data.eval, old_eval)
    ends = ByteTokenizer.eos_token_id if document_masking else None
    new_batches = TrainBatches(data.train, 8, 2, seed=0, documents_end_at=ends)
    old_batches = TrainBatches(old_train, 8, 2, seed=0, documents_end_at=ends)
    for step in (0, 1, 7, len(old_train) // 8 + 3):  # the last one in the second epoch
        for rank in range(2):
            for new, ref in zip(new_batches.micro_batches(step, rank, 2), old_batches.micro_batches(step, rank, 2)):
                for field in ("input_ids", "labels", "position_ids", "segment_ids"):
                    a, b = getattr(new, field), getattr(ref, field)
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert a.dtype == b.dtype == np.int64
                        np.testing.assert_array_equal(a, b)
    for new, ref in zip(EvalBatches(data.eval, 8, 1, 2, 0, ends), EvalBatches(old_eval, 8, 1, 2, 0, ends)):
        np.testing.assert_array_equal(new.input_ids, ref.input_ids)
        np.testing.assert_array_equal(new.labels, ref.labels)


def test_sequences_are_views_of_the_memory_mapped_stream():
    data = build_token_data(data_cfg(seq_len=64), 384, min_train_sequences=8)
    base = data.train
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap) and not data.train.flags.writeable
    assert data.train.nbytes + data.eval.nbytes > base.nbytes  # rows overlap by a token: views, not copies
    assert np.shares_memory(data.train[:2], base) and np.shares_memory(data.eval[-2:], base)


# ---------------------------------------------------------------- built once, reused, keyed

def test_built_once_then_mapped(tmp_path, capsys):
    cfg = data_cfg(tmp_path / "corpus.txt")
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"document {i} " * 20 for i in range(50)))
    build_token_data(cfg, 384, 4)
    assert "data: tokenising" in capsys.readouterr().out
    (folder,) = cache_dirs(tmp_path)
    meta = json.loads((tmp_path / "token_cache" / folder / cache.META).read_text())
    assert meta["n_documents"] == 50 and meta["dtype"] == "uint16" and meta["tokenizer"]["spec"] == "byte"
    for seq_len in (16, 33):  # another seq_len (or eval_fraction, document_masking) reads the same cache
        build_token_data(data_cfg(tmp_path / "corpus.txt", seq_len=seq_len, eval_fraction=0.2), 384, 4)
    assert capsys.readouterr().out == "" and cache_dirs(tmp_path) == [folder]


def test_an_edited_source_is_tokenised_again(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"first {i} " * 20 for i in range(40)))
    first = build_token_data(data_cfg(path), 384, 4)
    path.write_text("\n\n".join(f"second {i} " * 20 for i in range(40)))
    second = build_token_data(data_cfg(path), 384, 4)
    assert len(cache_dirs(tmp_path)) == 2
    np.testing.assert_array_equal(second.train[0], ByteTokenizer().encode_documents(["second 0 " * 20])[:17])
    assert not np.array_equal(first.train[0], second.train[0])


def test_data_cache_dir_wins(tmp_path):
    build_token_data(data_cfg(cache_dir=str(tmp_path / "mine")), 384, 4)
    assert len(list((tmp_path / "mine").iterdir())) >= 1 and cache_dirs(tmp_path) == []


def test_several_processes_give_the_same_stream(tmp_path):
    rows = [{"text": f"row {i} " + "abc " * (i % 7)} for i in range(2 * cache.ROWS_PER_PROCESS + 10)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    one = build_token_data(data_cfg(path, cache_dir=str(tmp_path / "one"), num_proc=1), 384, 4)
    two = build_token_data(data_cfg(path, cache_dir=str(tmp_path / "two"), num_proc=2), 384, 4)
    (meta,) = [json.loads(p.read_text()) for p in (tmp_path / "two").glob(f"*/{cache.META}")]
    assert meta["built"]["processes"] == 2
    np.testing.assert_array_equal(one.train, two.train)
    np.testing.assert_array_equal(one.train, in_memory_sequences([r["text"] for r in rows], 16)[:len(one.train)])


# ---------------------------------------------------------------- node-local rank 0 builds, the others wait

def test_other_local_ranks_wait_for_local_rank_0(tmp_path, monkeypatch):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"document {i} " * 30 for i in range(200)))
    env = {**os.environ, "LOCAL_RANK": "0", "PYTHONPATH": str(ROOT)}
    builder = subprocess.Popen([sys.executable, "-c", (
        "from portable_fsdp.config.schema import base_config\n"
        "from portable_fsdp.data.loader import build_token_data\n"
        f"cfg = base_config().data; cfg.source = {str(path)!r}; cfg.seq_len = 16\n"
        "build_token_data(cfg, 384, 4)\n")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    data = build_token_data(data_cfg(path), 384, 4, wait_s=120)  # starts before the builder has imported datasets
    out, err = builder.communicate(timeout=120)
    assert builder.returncode == 0, err
    (folder,) = cache_dirs(tmp_path)
    meta = json.loads((tmp_path / "token_cache" / folder / cache.META).read_text())
    assert meta["built"]["pid"] == builder.pid  # the waiting rank did not build it
    np.testing.assert_array_equal(data.train[:3], in_memory_sequences(sources.read_documents(str(path), ""), 16)[:3])
    assert not list((tmp_path / "token_cache").glob(".*.building"))  # the heartbeat is gone


def test_a_waiting_rank_gives_up_naming_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    with user_error("data.cache_dir", "rank 3 (local rank 1) waited 0.5 s for local rank 0 to tokenise bundled") as info:
        build_token_data(data_cfg(), 384, 4, wait_s=0.5)
    assert "heartbeat" in info.value.message and "never appeared" in info.value.message


def test_a_second_builder_keeps_the_first_cache(tmp_path):
    cfg = data_cfg()
    tokenizer, src = ByteTokenizer(), sources.resolve_source(cfg)
    final = cache.cache_path(cfg, src, tokenizer)
    final.parent.mkdir(parents=True)
    cache.build(final, cfg, src, tokenizer)
    before = (final / cache.META).read_text()
    cache.build(final, cfg, src, tokenizer)  # another machine's builder on a shared disk renames second
    assert (final / cache.META).read_text() == before
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # its temporary directory is gone


def test_a_failed_build_leaves_nothing(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "fine"}, {"text": None}])
    with user_error("data.source", "row 1 has no text in column 'text' (null)"):
        build_token_data(data_cfg(path), 384, 1)
    assert list((tmp_path / "token_cache").iterdir()) == [] or \
        all(p.name.startswith(".") and not p.is_dir() for p in (tmp_path / "token_cache").iterdir())


# ---------------------------------------------------------------- a cache that cannot be read

@pytest.fixture
def built(tmp_path):
    cfg = data_cfg()
    build_token_data(cfg, 384, 4)
    return cache.cache_path(cfg, sources.resolve_source(cfg), ByteTokenizer())


def test_an_emptied_cache_is_one_line(built):
    for file in built.iterdir():
        file.unlink()
    with user_error("data.cache_dir", f"{built} holds no meta.json: it is not a complete token cache"):
        build_token_data(data_cfg(), 384, 4)
    assert built.is_dir()  # nothing deleted behind the user's back


def test_an_unreadable_cache_is_one_line(built):
    (built / cache.META).write_text("{not json")
    with user_error("data.cache_dir", "cannot be read"):
        build_token_data(data_cfg(), 384, 4)


def test_a_truncated_cache_is_one_line(built):
    tokens = built / cache.TOKENS
    with open(tokens, "r+b") as f:
        f.truncate(tokens.stat().st_size - 10)
    with user_error("data.cache_dir", "the cache is damaged; delete"):
        build_token_data(data_cfg(), 384, 4)
    assert tokens.is_file()


def test_a_tokenizer_changed_in_place_is_refused(tmp_path):
    from tests.unit.test_data import save_tokenizer

    directory = save_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(["the quick brown fox jumps over a lazy dog"] * 40))
    build_token_data(data_cfg(corpus, seq_len=4, tokenizer=str(directory)), 384, 4)
    config_file = directory / "tokenizer.json"
    vocab = json.loads(config_file.read_text())
    vocab["model"]["vocab"] = {word: (len(vocab["model"]["vocab"]) - 1 - i)
                               for i, word in enumerate(vocab["model"]["vocab"])}  # the same words, other ids
    config_file.write_text(json.dumps(vocab))
    with user_error("data.tokenizer", "is not the tokenizer the token cache") as info:
        build_token_data(data_cfg(corpus, seq_len=4, tokenizer=str(directory)), 384, 4)
    assert "restore that tokenizer, or delete" in info.value.message


# ---------------------------------------------------------------- bad input: one line naming the file and the row

def test_text_file_with_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"fine text\n\nmore\nline three \xff here\n\nend")
    with user_error("data.source", f"{path} line 4: byte 0xff (offset 27) is not UTF-8 text"):
        build_token_data(data_cfg(path), 384, 1)


def test_jsonl_with_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "bad \xff\xfe"}\n{"text": "fine"}\n')
    with user_error("data.source", f"{path}: row 1 is not UTF-8 text"):
        build_token_data(data_cfg(path), 384, 1)


@pytest.mark.parametrize("values, row, phrase", [
    (["ok", 5, "fine"], 1, "holds int '5' in column 'text', not text"),
    ([1, 2], 0, "holds int '1' in column 'text', not text"),
    (["ok", "fine", None], 2, "has no text in column 'text' (null)"),
])
def test_rows_that_are_not_text(tmp_path, values, row, phrase):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": v} for v in values])
    with user_error("data.source", f"{path}: row {row} {phrase}"):
        build_token_data(data_cfg(path), 384, 1)


def test_a_column_that_does_not_exist(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"body": "x"}])
    with user_error("data.text_column", "'text' is not a column of") as info:
        build_token_data(data_cfg(path), 384, 1)
    assert "body" in info.value.message


def test_json_that_does_not_parse(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "x"\n')
    with user_error("data.source", f"cannot read {path}: "):
        build_token_data(data_cfg(path), 384, 1)


def test_empty_rows_are_skipped_as_before(tmp_path):
    texts = ["first document", "", "second"]
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in texts * 10])
    data = build_token_data(data_cfg(path, seq_len=4, eval_fraction=0.1), 384, 1)
    every = np.concatenate([data.train, data.eval])
    np.testing.assert_array_equal(every, in_memory_sequences([t for t in texts * 10 if t], 4)[:len(every)])


def test_cli_malformed_corpus_is_one_line_and_writes_nothing(tmp_path, capsys):
    from portable_fsdp import run
    from tests.conftest import TEST_RECIPE

    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "ok"}, {"text": 7}])
    code = run.main(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "w"), f"--config.data.source={path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: data.source: {path}: row 1 holds int '7' in column 'text', not text"]
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- hub datasets

def test_hub_dataset_offline_names_the_download(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with user_error("data.source", "hub dataset someorg/somedata (config wiki, split validation) is not in the local "
                    "Hugging Face cache and could not be downloaded (HF_HUB_OFFLINE is set)") as info:
        build_token_data(data_cfg("someorg/somedata", name="wiki", split="validation"), 384, 1)
    assert "datasets.load_dataset('someorg/somedata', 'wiki', split='validation')" in info.value.message


def test_hub_ids_and_missing_paths():
    assert sources.resolve_source(data_cfg("org/name")).kind == "hub"
    with user_error("data.source", "no such file or directory ./org/name"):
        sources.resolve_source(data_cfg("./org/name"))


# ---------------------------------------------------------------- chat

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
WORDS = "hello there how are you i am fine thanks what is two plus two four".split()


def save_chat_tokenizer(directory, template=CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(directory))
    return directory


CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello how are you"}],
    [{"role": "system", "content": "thanks"}, {"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "thanks"},
     {"role": "assistant", "content": "i am fine"}],
]


def assistant_ids(tok, conversation):
    """Each assistant turn's ids as the template renders them: its words and <|end|>."""
    return [tok._tok(f"{m['content']} <|end|>", add_special_tokens=False)["input_ids"]
            for m in conversation if m["role"] == "assistant"]


def test_chat_rows_take_the_loss_on_assistant_tokens_only(tmp_path):
    directory = save_chat_tokenizer(tmp_path / "chat_tok")
    tok = load_tokenizer(str(directory))
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS * 20])
    cfg = data_cfg(path, seq_len=8, tokenizer=str(directory), format="chat", eval_fraction=0.2)
    data = build_token_data(cfg, 384, 4)
    (ids, mask), = tok.encode_chats([CONVERSATIONS[1]])
    trained = [int(t) for t, m in zip(ids, mask) if m]
    expected = [t for turn in assistant_ids(tok, CONVERSATIONS[1]) for t in turn] + [tok.eos_token_id]
    assert trained == expected  # assistant words, their end-of-turn marker, the final end of document
    every = np.concatenate([data.train, data.eval])
    masks = np.concatenate([data.train_loss_mask, data.eval_loss_mask])
    batch = batch_lib.as_batch(every, None, masks)
    stream = np.concatenate([a for c in CONVERSATIONS * 20 for a in tok.encode_chats([c])[0][:1]])
    stream_mask = np.concatenate([m for c in CONVERSATIONS * 20 for m in [tok.encode_chats([c])[0][1]]])
    n = len(every) * 8
    np.testing.assert_array_equal(batch.input_ids.reshape(-1), stream[:n])
    np.testing.assert_array_equal(batch.labels.reshape(-1), np.where(stream_mask[1:n + 1] == 1,
                                                                     stream[1:n + 1], IGNORE_INDEX))
    # eval_loss is counted over the same tokens: each eval batch's label tokens are its assistant tokens
    evals = EvalBatches(data.eval, 4, 0, 1, 0, None, data.eval_loss_mask)
    assert sum(b.num_label_tokens for b in evals) == int(data.eval_loss_mask[:, 1:].sum())
    train = TrainBatches(data.train, 4, 1, 0, loss_mask=data.train_loss_mask).micro_batches(0, 0, 1)[0]
    rows = TrainBatches(data.train, 4, 1, 0).global_indices(0)
    assert train.num_label_tokens == int(data.train_loss_mask[rows][:, 1:].sum()) > 0


def test_chat_with_the_byte_tokenizer_names_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}])
    with user_error("data.tokenizer", "the byte tokenizer has none; set data.tokenizer to a local tokenizer "
                    "directory that has one"):
        build_token_data(data_cfg(path, format="chat"), 384, 1)


def test_chat_with_a_tokenizer_without_a_template(tmp_path):
    directory = save_chat_tokenizer(tmp_path / "plain_tok", template=None)
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}])
    with user_error("data.tokenizer", f"the tokenizer in {directory.resolve()} has none"):
        build_token_data(data_cfg(path, format="chat", tokenizer=str(directory)), 384, 1)


@pytest.mark.parametrize("rows, phrase", [
    ([{"messages": CONVERSATIONS[0]}, {"messages": "hello"}], "row 1 column 'messages' holds str, not a list"),
    ([{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "user"}]}], "row 1 message 0 of column 'messages'"),
])
def test_malformed_conversations(tmp_path, rows, phrase):
    directory = save_chat_tokenizer(tmp_path / "chat_tok")
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    with user_error("data.source", phrase):
        build_token_data(data_cfg(path, format="chat", tokenizer=str(directory)), 384, 1)


def test_chat_needs_a_messages_column(tmp_path):
    directory = save_chat_tokenizer(tmp_path / "chat_tok")
    path = write_jsonl(tmp_path / "chats.jsonl", [{"text": "x"}])
    with user_error("data.messages_column", "'messages' is not a column of"):
        build_token_data(data_cfg(path, format="chat", tokenizer=str(directory)), 384, 1)
    with user_error("data.format", "chat needs rows with a 'messages' column"):
        build_token_data(data_cfg("bundled", format="chat", tokenizer=str(directory)), 384, 1)


# ---------------------------------------------------------------- the epoch order, off the heap

def test_a_long_epoch_order_is_the_same_permutation_memory_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "ORDER_IN_MEMORY", 10)
    rows = np.repeat(np.arange(1000, dtype=np.int64)[:, None], 3, axis=1)
    in_memory = TrainBatches(rows, 8, 1, seed=4)
    on_disk = TrainBatches(rows, 8, 1, seed=4, order_dir=tmp_path / "orders")
    for step in (0, 1, 124, 125, 126, 380):  # 125 steps per epoch: into the fourth
        np.testing.assert_array_equal(on_disk.global_indices(step), in_memory.global_indices(step))
        assert isinstance(on_disk._perm_cache[step * 8 // 1000], np.memmap)
    # epochs 0 and 1 removed when epoch 3 began (the last epoch before the current one would stay)
    assert [p.name for p in (tmp_path / "orders").iterdir()] == ["order-seed4-epoch3-n1000.u32"]


def test_the_loop_keeps_long_orders_beside_the_cache(monkeypatch):
    monkeypatch.setattr(loader, "ORDER_IN_MEMORY", 10)
    config = base_config()
    config.data.seq_len = 64
    train, evals = loader.open_data(config, 384, 0, 1)
    assert train.order_dir.parent.parent == cache.cache_root(config.data)
    train.micro_batches(0, 0, 1)
    assert len(list(train.order_dir.glob("order-seed0-epoch0-n*.u32"))) == 1
    assert len(evals) > 0


def _mapped_rss_kb(path_part: str) -> int:
    """Resident KB of this process's mappings of files whose path contains `path_part` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[0].isupper() or line.startswith("VmFlags"):
                inside = path_part in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists(), reason="Linux /proc")
def test_read_rows_leave_no_mapped_pages_behind(tmp_path):
    data = build_token_data(data_cfg(seq_len=64), 384, 8)
    np.array(data.train[::50])  # read rows all over the stream
    assert _mapped_rss_kb(cache.TOKENS) > 100
    batches = TrainBatches(data.train, 8, 1, seed=0)
    for step in range(20):
        batches.micro_batches(step, 0, 1)
    for batch in EvalBatches(data.eval, 8, 0, 1):
        assert batch.num_label_tokens
    assert _mapped_rss_kb(cache.TOKENS) == 0  # in the page cache, not in this process's resident set
