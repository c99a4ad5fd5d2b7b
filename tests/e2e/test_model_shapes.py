"""Frozen parameters, tied embeddings and dimensions that do not divide by the world size: they train,
save, load outside FSDP and resume bit-exactly; rank-0 loading really reads the weights on rank 0 only."""
import json
import os
import textwrap

import pytest
import torch

from portable_fsdp.checkpoint import layout as checkpointing
from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.e2e.test_training_runs import _eval_loss_outside_fsdp

ODD = {"model.vocab_size": "385", "model.tie_word_embeddings": "true", "train.freeze": "layers.0.mlp"}
ARGS = ["--config", TEST_RECIPE, "--config.train.log_every=1"] + [f"--config.{k}={v}" for k, v in ODD.items()]


def losses(workdir):
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


@pytest.mark.slow  # three runs; tied and frozen weights also start, shard and checkpoint in tests/dist and tests/xla
def test_frozen_tied_uneven_model_trains_saves_and_resumes(tmp_path):
    straight = cli(ARGS + ["--workdir", str(tmp_path / "a")], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = cli(ARGS + ["--workdir", str(tmp_path / "b"), "--config.train.stop_at_step=10"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = cli(ARGS + ["--workdir", str(tmp_path / "b"), "--config.train.resume=true"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    from safetensors.torch import load_file

    start = load_file(checkpointing.root(tmp_path / "b") / "step_00000010" / "model.safetensors")
    end = load_file(checkpointing.latest(tmp_path / "b") / "model.safetensors")
    frozen = [k for k in end if "layers.0.mlp" in k]
    assert frozen and all(torch.equal(start[k], end[k]) for k in frozen)  # frozen: untouched
    assert not torch.equal(start["model.embed_tokens.weight"], end["model.embed_tokens.weight"])
    evals = [r for r in read_metrics(tmp_path / "a") if "eval_loss" in r]
    outside = _eval_loss_outside_fsdp(checkpointing.latest(tmp_path / "a"), ODD)
    assert outside == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


SITECUSTOMIZE = textwrap.dedent('''
    """Test probe: record which process opens weight files (safetensors opens them from Rust, so wrap it)."""
    import os, safetensors, safetensors.torch
    def _record(path):
        with open(os.environ["WEIGHT_OPENS_LOG"], "a") as f:
            f.write(f"{os.environ.get('RANK', 'launcher')} {path}\\n")
    _safe_open = safetensors.safe_open
    class _Probe:
        def __init__(self, path, *a, **k):
            _record(path)
            self._inner = _safe_open(path, *a, **k)
        def __enter__(self):
            return self._inner.__enter__()
        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)
        def __getattr__(self, name):
            return getattr(self._inner, name)
    safetensors.safe_open = _Probe
    _load_file = safetensors.torch.load_file
    def _probe_load_file(path, *a, **k):
        _record(path)
        return _load_file(path, *a, **k)
    safetensors.torch.load_file = _probe_load_file
''')


def test_cpu_ram_efficient_loading_reads_and_holds_the_model_on_rank0_only(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # ~25M parameters (100 MB in fp32): large enough for the memory difference to stand out.
    config = LlamaConfig(vocab_size=384, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "opens.log"
    env = {"PYTHONPATH": f"{probe}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "WEIGHT_OPENS_LOG": str(log)}
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "w"), f"--config.model.init_from={tmp_path / 'model'}",
                "--config.plan.cpu_ram_efficient_loading=true", "--config.train.steps=2", "--config.train.log_every=1",
                "--config.train.eval_max_batches=1", "--config.train.save_every=0", "--config.train.steps=1"],
               cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    readers = {line.split()[0] for line in log.read_text().splitlines() if "model.safetensors" in line
               and str(tmp_path / "model") in line}
    assert readers == {"0"}  # rank 1 never opened the weights (the launcher only reads config.json)
    start = next(r for r in read_metrics(tmp_path / "w") if r.get("event") == "start")
    assert start["peak_mem_mb"][0] - start["peak_mem_mb"][1] > 0.5 * 100  # rank 1 never held a full copy (~100 MB)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["tie_word_embeddings"] is True
