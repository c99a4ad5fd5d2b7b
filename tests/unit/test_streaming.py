"""data.streaming (portable_fsdp/data/streaming.py): a local jsonl read as an IterableDataset, packed on the fly into
the token cache's sequences, and resumed from the position a checkpoint records."""
import json
import pathlib

import numpy as np
import pytest

from portable_fsdp.config.schema import base_config
from portable_fsdp.data.batch import DATA_STATE, IGNORE_INDEX
from portable_fsdp.data.loader import build_token_data, open_data
from portable_fsdp.data.streaming import StreamingBatches
from tests.unit._helpers import user_error
from tests.unit.test_token_cache import CONVERSATIONS, save_chat_tokenizer

SEQ_LEN, EVAL, BATCH = 16, 8, 4


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTABLE_FSDP_DATA_CACHE", str(tmp_path / "token_cache"))
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", pathlib.Path(tmp_path / "hf_cache"))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"text": f"doc {i} " + "word " * (i % 13) if i % 17 else ""} for i in range(120)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(source, **data):
    c = base_config()
    c.data.source, c.data.seq_len, c.data.streaming, c.data.eval_sequences = str(source), SEQ_LEN, True, EVAL
    c.train.batch_size = BATCH
    for name, value in data.items():
        c.data[name] = value
    return c


def cached_windows(source, **data):
    """Every window of the token cache's stream of the same corpus, in order."""
    c = config(source, **data)
    c.data.streaming = False
    d = build_token_data(c.data, 384, 1)
    return np.concatenate([d.train, d.eval]).astype(np.int64)


def test_streamed_windows_are_the_cached_stream_in_order(corpus):
    every = cached_windows(corpus)
    stream = StreamingBatches(config(corpus), 384)
    np.testing.assert_array_equal(stream.eval_rows, every[:EVAL])
    n_train = len(every) - EVAL
    epochs = []
    for step in range(n_train // BATCH + 2):  # into the second epoch
        rows = stream.micro_batches(step, 0, 1)[0].input_ids
        index = [EVAL + (k % n_train) for k in range(step * BATCH, (step + 1) * BATCH)]
        np.testing.assert_array_equal(rows, every[index, :-1])
        epochs.append(stream.epoch_of(step + 1))  # as the loop asks: once the step is read
    assert epochs[0] == 0.0 and epochs[-1] == 1.0


def test_ranks_and_accumulation_split_one_global_batch(corpus):
    whole = StreamingBatches(config(corpus), 384).micro_batches(2, 0, 1)[0].input_ids
    c = config(corpus)
    c.train.grad_accum_steps = 2
    parts = [StreamingBatches(c, 384).micro_batches(2, r, 2) for r in range(2)]
    joined = np.concatenate([parts[r][m].input_ids for m in range(2) for r in range(2)])
    np.testing.assert_array_equal(joined, whole)


@pytest.mark.parametrize("stop", [1, 5, 33])  # 33: after the epoch ended
def test_resume_skips_what_was_consumed(corpus, tmp_path, stop):
    straight = StreamingBatches(config(corpus), 384)
    expected = [straight.micro_batches(s, 0, 1)[0] for s in range(stop + 4)]
    first = StreamingBatches(config(corpus), 384)
    for s in range(stop):
        first.micro_batches(s, 0, 1)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / DATA_STATE).write_text(json.dumps(first.state_at(stop)))
    resumed = StreamingBatches(config(corpus), 384)
    resumed.restore(checkpoint, stop)
    for s in range(stop, stop + 4):
        got = resumed.micro_batches(s, 0, 1)[0]
        np.testing.assert_array_equal(got.input_ids, expected[s].input_ids)
        np.testing.assert_array_equal(got.labels, expected[s].labels)


def test_resume_needs_the_position_and_the_same_data(corpus, tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    with user_error("train.resume", "holds no data_state.json: it was not saved by a data.streaming run"):
        StreamingBatches(config(corpus), 384).restore(checkpoint, 3)
    stream = StreamingBatches(config(corpus), 384)
    stream.micro_batches(0, 0, 1)
    (checkpoint / DATA_STATE).write_text(json.dumps(stream.state_at(1)))
    with user_error("data.source", "streamed other data (seq_len differ from this run's)"):
        StreamingBatches(config(corpus, seq_len=8), 384).restore(checkpoint, 1)


def test_a_corpus_too_short_for_eval_and_one_batch(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"text": "x" * 200}) + "\n")  # 12 windows of 16: 8 eval, 4 train = one batch
    StreamingBatches.check(config(path), 384)
    path.write_text(json.dumps({"text": "x" * 150}) + "\n")
    with user_error("data.source", "gives 9 sequences of data.seq_len=16 in one pass, too few for "
                    "data.eval_sequences=8"):
        StreamingBatches.check(config(path), 384)


def test_bad_rows_in_a_stream_name_the_row(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "fine " * 40}) + "\n" for _ in range(3)) + '{"text": 5}\n')
    c = config(path)
    c.data.eval_sequences = 30  # read into row 3
    with user_error("data.source", f"{path.resolve()}: row 3 holds int '5' in column 'text', not text"):
        StreamingBatches(c, 384)


def test_a_streamed_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 5 for i in range(60)))
    every = cached_windows(path)
    stream = StreamingBatches(config(path), 384)
    np.testing.assert_array_equal(stream.micro_batches(0, 0, 1)[0].input_ids, every[EVAL:EVAL + BATCH, :-1])


def test_streamed_chat_keeps_the_assistant_mask(tmp_path):
    directory = save_chat_tokenizer(tmp_path / "chat_tok")
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 30))
    fields = {"tokenizer": str(directory), "format": "chat", "seq_len": 8}
    c = config(path, **fields)
    c.data.streaming = False
    cached = build_token_data(c.data, 384, 1)
    rows = np.concatenate([cached.train, cached.eval]).astype(np.int64)
    mask = np.concatenate([cached.train_loss_mask, cached.eval_loss_mask])
    train, evals = open_data(config(path, **fields), 384, 0, 1)
    got = train.micro_batches(1, 0, 1)[0]
    span = slice(EVAL + BATCH, EVAL + 2 * BATCH)
    np.testing.assert_array_equal(got.labels, np.where(mask[span, 1:] == 1, rows[span, 1:], IGNORE_INDEX))
    assert sum(b.num_label_tokens for b in evals) == int(mask[:EVAL, 1:].sum())
