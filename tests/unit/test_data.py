"""Sources, tokenizers and the packed, deterministic loader (portable_fsdp/data/)."""
import json
import pathlib

import numpy as np
import pytest

from portable_fsdp.config.schema import base_config
from portable_fsdp.data import batch as batch_lib, sources, tokenizers
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.data.batch import EvalBatches
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.data.tokenizers import ByteTokenizer, load_tokenizer
from tests.unit._helpers import user_error

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras".split()


def make_text(n_docs=40, words_per_doc=30, seed=0):
    rng = np.random.default_rng(seed)
    return ["{} {}".format(i, " ".join(rng.choice(WORDS, words_per_doc))) for i in range(n_docs)]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(make_text()), encoding="utf-8")
    return path


def data_cfg(source, seq_len=16, tokenizer="byte", eval_fraction=0.1, text_column="text"):
    cfg = base_config().data
    cfg.source = str(source)
    cfg.seq_len = seq_len
    cfg.tokenizer = str(tokenizer)
    cfg.eval_fraction = eval_fraction
    cfg.text_column = text_column
    return cfg


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Keep `datasets`' cache of built json/csv files, and our token cache, out of the user's home."""
    monkeypatch.setenv("PORTABLE_FSDP_DATA_CACHE", str(tmp_path / "token_cache"))
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", pathlib.Path(tmp_path / "hf_cache"))


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    docs = ["héllo wörld", "", "日本語 ✓", "plain"]
    ids = ByteTokenizer().encode_documents(docs)
    assert ids.dtype == np.int32
    assert ids.max() <= ByteTokenizer.eos_token_id < ByteTokenizer.vocab_size
    pieces = bytes(ids[ids != 256].astype(np.uint8)).decode("utf-8")
    assert pieces == "".join(docs)
    ends = np.flatnonzero(ids == 256)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert [bytes(ids[s:e].astype(np.uint8)).decode("utf-8") for s, e in zip(starts, ends)] == docs


def test_byte_tokenizer_no_documents():
    assert ByteTokenizer().encode_documents([]).shape == (0,)


def test_load_tokenizer_byte_and_missing_dir(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with user_error("data.tokenizer", "must be 'byte', a local tokenizer directory or a hub id"):
        load_tokenizer(str(tmp_path / "nope"))


def test_load_tokenizer_from_a_directory_without_one(tmp_path):
    with user_error("data.tokenizer", f"cannot load a tokenizer from {tmp_path}"):
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- packing

def test_text_file_source_splits_on_blank_lines(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("first doc\nline two\n\n\n\nsecond\n\n   \n\nthird", encoding="utf-8")
    assert sources.read_documents(str(path), "ignored") == ["first doc\nline two", "second", "third"]


def test_text_file_without_suffix(tmp_path):
    path = tmp_path / "README"
    path.write_text("a\n\nb")
    assert sources.read_documents(str(path), "text") == ["a", "b"]


def test_missing_source(tmp_path):
    with user_error("data.source", "no such file or directory"):
        sources.read_documents(str(tmp_path / "nope.txt"), "text")


def test_unreadable_suffix(tmp_path):
    path = tmp_path / "corpus.xml"
    path.write_text("<a/>")
    with user_error("data.source", "cannot read corpus.xml"):
        sources.read_documents(str(path), "text")


def test_bundled_corpus_has_documents():
    docs = sources.read_documents("bundled", "text")
    assert len(docs) > 100 and sum(map(len, docs)) > 100_000


def token_stream(path):
    return ByteTokenizer().encode_documents(sources.read_documents(str(path), "text"))


def test_sequences_hold_seq_len_plus_one_tokens(text_file):
    data = build_token_data(data_cfg(text_file, seq_len=16), 384, min_train_sequences=4)
    assert data.train.shape[1] == data.eval.shape[1] == 17
    # stored compact (the token cache's uint16 for a vocabulary of 257), handed out as int64 ids
    assert data.train.dtype == data.eval.dtype == np.uint16
    assert batch_lib.as_batch(data.train[:2]).input_ids.dtype == np.int64
    assert data.vocab_size == 257
    n = len(data.train) + len(data.eval)
    assert n == (len(token_stream(text_file)) - 1) // 16
    assert len(data.eval) == max(1, int(n * 0.1))


def test_labels_are_inputs_shifted_by_one_over_the_whole_sequence(text_file):
    seq_len = 16
    tokens = token_stream(text_file)
    data = build_token_data(data_cfg(text_file, seq_len=seq_len), 384, min_train_sequences=4)
    batch = batch_lib.as_batch(data.train)
    assert batch.input_ids.shape == batch.labels.shape == (len(data.train), seq_len)
    np.testing.assert_array_equal(batch.labels[:, :-1], batch.input_ids[:, 1:])
    for i in range(len(data.train)):
        np.testing.assert_array_equal(batch.input_ids[i], tokens[i * seq_len:(i + 1) * seq_len])
        np.testing.assert_array_equal(batch.labels[i], tokens[i * seq_len + 1:(i + 1) * seq_len + 1])


def test_consecutive_windows_cover_every_token_once(text_file):
    seq_len = 13
    tokens = token_stream(text_file)
    data = build_token_data(data_cfg(text_file, seq_len=seq_len), 384, min_train_sequences=4)
    every = np.concatenate([data.train, data.eval])
    n = len(every)
    np.testing.assert_array_equal(every[:, :-1].reshape(-1), tokens[:n * seq_len])  # each input once
    np.testing.assert_array_equal(every[:, 1:].reshape(-1), tokens[1:n * seq_len + 1])  # each label once
    assert n * seq_len + 1 <= len(tokens) < (n + 1) * seq_len + 1  # no whole window left out


def test_too_short_data(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("x" * 100)
    with user_error("data.source", "too few for 1 eval sequences and one global batch of 8") as info:
        build_token_data(data_cfg(path, seq_len=16), 384, min_train_sequences=8)
    assert "101 tokens = 6 sequences" in info.value.message


def test_empty_text_file_byte_tokenizer(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n\n  \n")
    with user_error("data.source", "too few"):
        build_token_data(data_cfg(path), 384, min_train_sequences=1)


def test_vocab_larger_than_model(text_file):
    with user_error("model.vocab_size", "100 is smaller than the tokenizer's 257 ids") as info:
        build_token_data(data_cfg(text_file), 100, min_train_sequences=1)
    assert "model.vocab_size >= 257" in info.value.message


def test_vocab_equal_to_model_is_enough(text_file):
    build_token_data(data_cfg(text_file), 257, min_train_sequences=1)


# ---------------------------------------------------------------- TrainBatches

def sequences(n=24, width=5):
    """Row i is [i, i, ...]: the row's id is readable from any token."""
    return np.repeat(np.arange(n, dtype=np.int64)[:, None], width, axis=1)


def rows(batches):
    return np.concatenate([b.input_ids[:, 0] for b in batches])


def global_rows(train, step, dp_size):
    """Concatenate micro-batch m of every rank, for every m: the global batch as the ranks see it."""
    per_rank = [train.micro_batches(step, r, dp_size) for r in range(dp_size)]
    return np.concatenate([rows([per_rank[r][m]]) for m in range(train.grad_accum) for r in range(dp_size)])


def test_batch_shapes_and_labels():
    train = TrainBatches(sequences(), global_batch=8, grad_accum=2, seed=0)
    micro = train.micro_batches(0, dp_rank=1, dp_size=2)
    assert len(micro) == 2
    for b in micro:
        assert b.input_ids.shape == b.labels.shape == (2, 4)
        assert b.input_ids.dtype == np.int64 and b.input_ids.flags.c_contiguous and b.labels.flags.c_contiguous
        assert b.num_label_tokens == 8


def test_same_seed_and_step_same_batch():
    a = TrainBatches(sequences(), 8, 1, seed=3)
    b = TrainBatches(sequences(), 8, 1, seed=3)
    for step in (7, 0, 2, 7):  # any order, e.g. after a resume
        np.testing.assert_array_equal(rows(a.micro_batches(step, 0, 1)), rows(b.micro_batches(step, 0, 1)))
    fresh = TrainBatches(sequences(), 8, 1, seed=3)
    np.testing.assert_array_equal(fresh.global_indices(5), a.global_indices(5))


def test_different_steps_and_seeds_differ():
    a = TrainBatches(sequences(), 8, 1, seed=0)
    assert not np.array_equal(a.global_indices(0), a.global_indices(1))
    assert not np.array_equal(a.global_indices(0), a.global_indices(3))  # next epoch: a new order
    b = TrainBatches(sequences(), 8, 1, seed=1)
    assert not np.array_equal(a.global_indices(0), b.global_indices(0))


@pytest.mark.parametrize("dp_size, grad_accum", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (2, 4), (8, 1)])
def test_global_batch_independent_of_split(dp_size, grad_accum):
    reference = TrainBatches(sequences(), 8, 1, seed=5)
    train = TrainBatches(sequences(), 8, grad_accum, seed=5)
    for step in range(7):
        expected = reference.global_indices(step)
        np.testing.assert_array_equal(global_rows(train, step, dp_size), expected)
        np.testing.assert_array_equal(global_rows(reference, step, 1), expected)


def test_ranks_get_disjoint_rows():
    train = TrainBatches(sequences(), 8, 2, seed=0)
    seen = np.concatenate([rows(train.micro_batches(1, r, 2)) for r in range(2)])
    assert len(set(seen.tolist())) == 8


@pytest.mark.parametrize("n, batch", [(24, 8), (10, 4), (7, 3)])
def test_epochs_are_permutations(n, batch):
    train = TrainBatches(sequences(n), batch, 1, seed=11)
    n_steps = 3 * n  # 3 * batch epochs of n rows each
    flat = np.concatenate([train.global_indices(s) for s in range(n_steps)])
    epochs = flat.reshape(-1, n)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))
    assert len({tuple(e) for e in epochs}) > 1


def test_epoch_of():
    train = TrainBatches(sequences(24), 8, 1, seed=0)
    assert train.epoch_of(0) == 0 and train.epoch_of(3) == 1.0 and train.epoch_of(6) == 2.0


# ---------------------------------------------------------------- eval_batches

@pytest.mark.parametrize("n, global_batch, dp_size, max_batches, expected_batches", [
    (10, 4, 2, 0, 3), (10, 4, 1, 0, 3), (8, 4, 2, 0, 2), (5, 4, 4, 0, 2), (10, 4, 2, 2, 2), (3, 8, 4, 0, 1),
])
def test_eval_batches_same_count_on_every_rank(n, global_batch, dp_size, max_batches, expected_batches):
    seqs = sequences(n) + 1  # ids 1..n, so zero padding is recognisable
    per_rank = [EvalBatches(seqs, global_batch, r, dp_size, max_batches) for r in range(dp_size)]
    assert {len(b) for b in per_rank} == {expected_batches}
    for batches in per_rank:
        for b in batches:
            assert b.input_ids.shape == (global_batch // dp_size, seqs.shape[1] - 1)
    # every real row exactly once, in order; padded rows carry no labels
    real = []
    for k in range(expected_batches):
        for r in range(dp_size):
            b = per_rank[r][k]
            for row_in, row_lab in zip(b.input_ids, b.labels):
                if not (row_lab == IGNORE_INDEX).all():
                    assert (row_lab != IGNORE_INDEX).all()
                    real.append(row_in[0])
    kept = min(n, expected_batches * global_batch)
    np.testing.assert_array_equal(real, np.arange(1, kept + 1))
    total = sum(b.num_label_tokens for batches in per_rank for b in batches)
    assert total == kept * (seqs.shape[1] - 1)


def test_eval_padding_rows_are_all_ignore_index():
    batches = EvalBatches(sequences(5) + 1, 4, dp_rank=1, dp_size=2)
    last = batches[-1]
    assert (last.labels == IGNORE_INDEX).all() and last.num_label_tokens == 0


@pytest.mark.parametrize("n, global_batch, dp_size", [(1, 2, 2), (5, 4, 4), (3, 4, 1)])
def test_eval_padding_rows_keep_valid_input_ids(n, global_batch, dp_size):
    # Padded rows must be ignored through their labels only: their input ids still feed the embedding,
    # so they must stay valid token ids (never IGNORE_INDEX), whatever the rows per rank.
    seqs = sequences(n) + 1
    for rank in range(dp_size):
        for b in EvalBatches(seqs, global_batch, rank, dp_size):
            assert (b.input_ids >= 0).all(), f"rank {rank}: input_ids {b.input_ids.tolist()}"


def test_eval_batches_do_not_modify_input():
    seqs = sequences(5) + 1
    copy = seqs.copy()
    EvalBatches(seqs, 4, 0, 1)
    np.testing.assert_array_equal(seqs, copy)


# ---------------------------------------------------------------- `datasets` sources

def write_jsonl(path, texts, column="text"):
    path.write_text("\n".join(json.dumps({column: t, "id": i}) for i, t in enumerate(texts)) + "\n")
    return path


def test_jsonl_source_with_text_column(tmp_path):
    texts = make_text(5)
    path = write_jsonl(tmp_path / "docs.jsonl", texts[:2] + [""] + texts[2:], column="body")
    assert sources.read_documents(str(path), "body") == texts  # empty texts dropped


def test_jsonl_source_missing_column(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", ["a", "b"], column="body")
    with user_error("data.text_column", "'text' is not a column of") as info:
        sources.read_documents(str(path), "text")
    assert "body" in info.value.message


def test_jsonl_source_through_build_token_data(tmp_path):
    texts = make_text(30)
    path = write_jsonl(tmp_path / "docs.jsonl", texts, column="content")
    data = build_token_data(data_cfg(path, text_column="content"), 384, min_train_sequences=4)
    expected = ByteTokenizer().encode_documents(texts)
    np.testing.assert_array_equal(data.train[0], expected[:17])


def test_saved_dataset_directory(tmp_path):
    import datasets

    texts = make_text(6)
    datasets.Dataset.from_dict({"body": texts, "n": list(range(6))}).save_to_disk(str(tmp_path / "ds"))
    assert sources.read_documents(str(tmp_path / "ds"), "body") == texts
    with user_error("data.text_column", "'text' is not a column of"):
        sources.read_documents(str(tmp_path / "ds"), "text")


def test_saved_dataset_dict_uses_train_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["tr1", "tr2"]}),
                               "test": datasets.Dataset.from_dict({"text": ["te"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert sources.read_documents(str(tmp_path / "dd"), "text") == ["tr1", "tr2"]
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["v"]})}).save_to_disk(
        str(tmp_path / "nodd"))
    with user_error("data.source", "no 'train' split"):
        sources.read_documents(str(tmp_path / "nodd"), "text")


def test_directory_that_is_not_a_dataset(tmp_path):
    (tmp_path / "plain").mkdir()
    with user_error("data.source", "is not a dataset saved with save_to_disk"):
        sources.read_documents(str(tmp_path / "plain"), "text")


# ---------------------------------------------------------------- local Hugging Face tokenizer

TOKENIZER_TEXTS = make_text(20, seed=1)


def save_tokenizer(directory, eos_token="</s>"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TOKENIZER_TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    kwargs = {"eos_token": eos_token} if eos_token else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **kwargs).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


def test_local_hf_tokenizer(hf_tokenizer_dir):
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, tokenizers.LocalHFTokenizer)
    words = {w for text in TOKENIZER_TEXTS for w in text.split()}
    assert tok.vocab_size == len(words) + 2  # the words, [UNK], </s>
    ids = tok.encode_documents(["the fox", "zebras"])
    assert ids.tolist() == tok._tok("the fox")["input_ids"] + [tok.eos_token_id] + \
        tok._tok("zebras")["input_ids"] + [tok.eos_token_id]
    assert tok._tok.decode(ids[:2].tolist()) == "the fox"


def test_local_hf_tokenizer_through_config(hf_tokenizer_dir, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(TOKENIZER_TEXTS * 3))
    data = build_token_data(data_cfg(path, seq_len=8, tokenizer=hf_tokenizer_dir), 384, min_train_sequences=4)
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert data.vocab_size == tok.vocab_size
    assert data.train.max() < tok.vocab_size
    expected = tok.encode_documents(sources.read_documents(str(path), "text"))
    np.testing.assert_array_equal(data.train[1], expected[8:17])
    with user_error("model.vocab_size", f"smaller than the tokenizer's {tok.vocab_size} ids"):
        build_token_data(data_cfg(path, seq_len=8, tokenizer=hf_tokenizer_dir), 10, min_train_sequences=4)


def test_local_hf_tokenizer_without_eos(tmp_path):
    directory = save_tokenizer(tmp_path / "noeos", eos_token=None)
    with user_error("data.tokenizer", "has no eos token"):
        load_tokenizer(str(directory))


def test_empty_text_file_hf_tokenizer(hf_tokenizer_dir, tmp_path):
    # With no text at all the byte tokenizer gives a clear data.source error; a local tokenizer must too.
    path = tmp_path / "empty.txt"
    path.write_text("\n\n  \n")
    with user_error("data.source", "too few"):
        build_token_data(data_cfg(path, tokenizer=hf_tokenizer_dir), 384, min_train_sequences=1)
