"""FULL checkpoints as they must be at size (portable_fsdp/checkpoint/safetensors_shards.py, checkpointing.py): the weights
in several safetensors files + an index, each written and checksummed by the rank that owns it, resumed on every
backend and loaded by transformers' pipeline as they are; a bfloat16 export; an index naming a missing file."""
import json
import shutil

import pytest

from portable_fsdp.checkpoint import layout as checkpointing
from tests.conftest import TEST_RECIPE, cli, read_metrics

BASE = ["--config", TEST_RECIPE, "--config.train.log_every=1", "--config.train.steps=6",
        "--config.train.warmup_steps=2"]
SMALL_SHARDS = "--config.train.max_shard_size=100KB"  # the test model's ~1.6 MB of weights: several files


def losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def run(workdir, *args, env=None):
    proc = cli(BASE + ["--workdir", str(workdir), *args], cwd=workdir.parent, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight") / "run"
    run(workdir)
    return losses(workdir)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """2 ranks, stopped after step 3 with its weights in 100 KB files."""
    workdir = tmp_path_factory.mktemp("stopped") / "run"
    run(workdir, SMALL_SHARDS, "--config.train.stop_at_step=3")
    return workdir


def resumable_copy(stopped, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(stopped, workdir)
    return workdir


def test_the_weights_are_split_and_every_file_checksummed(stopped):
    final = checkpointing.latest(stopped)
    index = json.loads((final / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and not (final / "model.safetensors").exists()
    sizes = {f: (final / f).stat().st_size for f in files}
    biggest_tensor = 384 * 64 * 4 + 1000  # the embedding, and a header
    assert all(size <= max(100_000, biggest_tensor) for size in sizes.values()), sizes
    manifest = checkpointing.verify(final)
    assert set(files) <= set(manifest["files"]) and manifest["weights_dtype"] == "float32"
    assert not (final / checkpointing.REPORTS).exists()


@pytest.mark.slow  # bit-exact resume stays in the default suite (tests/e2e/test_reliability.py, tests/dist)
def test_small_shards_resume_bit_exact(tmp_path, stopped, straight):
    workdir = resumable_copy(stopped, tmp_path)
    run(workdir, SMALL_SHARDS, "--config.train.resume=true")
    assert losses(workdir) == straight


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "flax"])
def test_small_shards_written_on_cpu_resume_on(tmp_path, stopped, straight, backend):
    from tests.xla.helpers import XLA_ENV

    workdir = resumable_copy(stopped, tmp_path)
    env = {k: v for k, v in XLA_ENV.items() if k != "PJRT_DEVICE"} if backend == "xla" else None
    run(workdir, "--backend", backend, SMALL_SHARDS, "--config.train.resume=true", env=env)
    got = losses(workdir)
    assert all(abs(got[s] - straight[s]) <= 1e-4 * straight[s] for s in (4, 5, 6)), (got, straight)
    final = checkpointing.latest(workdir)  # and what it wrote is split alike, every file there
    assert len(json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    checkpointing.verify(final)


def test_a_full_checkpoint_runs_in_a_text_generation_pipeline(stopped):
    from transformers import pipeline

    final = checkpointing.latest(stopped)
    generate = pipeline("text-generation", model=str(final))
    assert generate.tokenizer("hi!", add_special_tokens=False)["input_ids"] == list(b"hi!")  # the byte tokenizer
    assert generate.model.generation_config.eos_token_id == 256
    out = generate("The ", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("The ") and len(out[0]["generated_text"]) > len("The ")


@pytest.mark.slow  # two runs
def test_a_bfloat16_export_halves_the_weights_and_resumes_with_a_warning(tmp_path, stopped, straight):
    workdir = tmp_path / "run"
    run(workdir, "--config.train.save_dtype=bfloat16", "--config.train.stop_at_step=3")
    final = checkpointing.latest(workdir)
    full = checkpointing.latest(stopped)
    weights = lambda d: sum(p.stat().st_size for p in d.glob("model*.safetensors"))  # noqa: E731
    assert weights(final) == pytest.approx(weights(full) / 2, rel=0.02)
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert checkpointing.read_manifest(final)["weights_dtype"] == "bfloat16"
    proc = run(workdir, "--config.train.resume=true")
    warnings = [line for line in proc.stderr.splitlines() if "not bit-exact" in line]
    assert warnings == ["warning: step_00000003 holds its weights in bfloat16 (train.save_dtype): they are cast "
                        "back to the training dtype, so this resume is not bit-exact"]
    got = losses(workdir)
    assert all(abs(got[s] - straight[s]) <= 1e-2 * straight[s] for s in (4, 5, 6)), (got, straight)


def test_an_index_naming_a_missing_file_is_refused_in_one_line(tmp_path, stopped):
    model = tmp_path / "model"
    shutil.copytree(checkpointing.latest(stopped), model)
    missing = sorted(set(json.loads((model / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (model / missing).unlink()
    proc = cli(BASE + ["--workdir", str(tmp_path / "w"), f"--config.model.init_from={model}"], cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert errors == [f"error: model.init_from: {model}/model.safetensors.index.json names {missing}, which is "
                      "missing: the checkpoint is incomplete; copy the file back or use another checkpoint"]
    workdir = resumable_copy(stopped, tmp_path)  # resuming: the manifest's check names it first
    (checkpointing.latest(workdir) / missing).unlink()
    proc = cli(BASE + ["--workdir", str(workdir), "--config.train.resume=true"], cwd=tmp_path)
    assert proc.returncode == 2 and f"{missing} is missing; the checkpoint is incomplete" in proc.stderr


ASYNC = ["--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.async_save=true",
         "--config.train.save_every=2"]


@pytest.mark.slow  # two runs
def test_async_sharded_saves_commit_in_the_background_and_resume_bit_exact(tmp_path, straight):
    workdir = tmp_path / "run"
    run(workdir, *ASYNC, "--config.train.stop_at_step=3")  # saves at 2 (in the background) and 3 (the stop)
    saved = sorted(p.name for p in checkpointing.root(workdir).glob("step_*"))
    assert saved == ["step_00000002", "step_00000003"] and checkpointing.latest(workdir).name == "step_00000003"
    for name in saved:
        manifest = checkpointing.verify(checkpointing.root(workdir) / name)
        assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(manifest["files"])
    assert not list(checkpointing.root(workdir).glob(".tmp-step_*"))
    run(workdir, *ASYNC, "--config.train.resume=true")
    assert losses(workdir) == straight


def test_async_save_of_a_full_checkpoint_is_refused_in_one_line(tmp_path):
    proc = cli(BASE + ["--workdir", str(tmp_path / "w"), "--config.train.async_save=true"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: train.async_save: applies to SHARDED_STATE_DICT saves (a FULL one is gathered and written while "
        "training waits); set plan.state_dict_type=SHARDED_STATE_DICT or train.async_save=false"]


def test_init_from_a_split_checkpoint_reads_every_file_through_the_index(stopped):
    """model.init_from's loader (every backend's: hf_torch.model.create_on_meta) delivers each tensor of the
    split files once, as the files hold them."""
    from safetensors.torch import load_file

    from portable_fsdp.backends.hf_torch.model import create_on_meta
    from portable_fsdp.config.schema import apply_override, load_recipe

    final = checkpointing.latest(stopped)
    config = load_recipe(TEST_RECIPE)
    apply_override(config, "model.init_from", str(final))
    delivered = {}
    create_on_meta(config).fill(lambda names, full: delivered.update({names[0]: full}))
    stored = {}
    for file in final.glob("model-*.safetensors"):
        stored.update(load_file(file))
    assert delivered.keys() == stored.keys() and all(delivered[n].equal(stored[n]) for n in stored)


def test_a_local_tokenizer_is_saved_beside_the_model(tmp_path):
    """data.tokenizer as a directory: its files are saved, and generation ends at its end-of-document token."""
    from transformers import AutoTokenizer

    from portable_fsdp.data.tokenizers import byte_tokenizer_for_transformers, save_for_generation

    byte_tokenizer_for_transformers().save_pretrained(tmp_path / "tokenizer")  # any local tokenizer directory
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    written = save_for_generation(str(tmp_path / "tokenizer"), tmp_path / "out")
    assert tmp_path / "out" / "tokenizer.json" in written and tmp_path / "out" / "generation_config.json" in written
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("ab")["input_ids"] == [97, 98]
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 256, "pad_token_id": 256}
