"""The data pipeline as users run it: chat data through the command line, and a streamed corpus resumed where it
stood."""
import json

import numpy as np
import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.unit.test_token_cache import CONVERSATIONS, save_chat_tokenizer


def _losses(workdir):
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def test_chat_run_takes_the_loss_on_assistant_tokens(tmp_path):
    """data.format=chat: eval_tokens counts the assistant tokens of the eval batches, nothing else."""
    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.data.batch import EvalBatches
    from portable_fsdp.data.loader import build_token_data

    directory = save_chat_tokenizer(tmp_path / "chat_tok")
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 60))
    overrides = {"data.source": str(path), "data.format": "chat", "data.tokenizer": str(directory),
                 "data.seq_len": "16", "train.steps": "4", "train.eval_every": "4"}
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "w"), "--nproc", "1",
                *[f"--config.{k}={v}" for k, v in overrides.items()]], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (evaluated,) = [r for r in read_metrics(tmp_path / "w") if "eval_loss" in r]
    config = load_recipe(TEST_RECIPE)
    for key, value in overrides.items():
        apply_override(config, key, value)
    data = build_token_data(config.data, config.model.vocab_size, 1)
    batches = EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, config.train.eval_max_batches,
                           loss_mask=data.eval_loss_mask)
    assistant = sum(b.num_label_tokens for b in batches)
    assert evaluated["eval_tokens"] == assistant
    assert 0 < assistant < sum(b.labels.size for b in batches) // 2  # most tokens are not the assistant's
    assert np.isfinite(evaluated["eval_loss"])


@pytest.mark.slow
def test_streamed_corpus_resumes_where_it_stood(tmp_path):
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta shard gather scatter reduce".split()
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(n)))}) + "\n"
                            for n in rng.integers(5, 60, 400)))
    common = ["--config", TEST_RECIPE, f"--config.data.source={path}", "--config.data.streaming=true",
              "--config.data.eval_sequences=16", "--config.train.steps=12", "--config.train.log_every=1"]
    straight = cli(common + ["--workdir", str(tmp_path / "straight")], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = cli(common + ["--workdir", str(tmp_path / "split"), "--config.train.stop_at_step=5"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "split" / "checkpoints" / "step_00000005" / "data_state.json").read_text())
    assert state["step"] == 5 and state["document"] > 0
    second = cli(common + ["--workdir", str(tmp_path / "split"), "--config.train.resume=true"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    expected, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == expected  # bit-exact: the resumed run read the stream from where the first one stopped
