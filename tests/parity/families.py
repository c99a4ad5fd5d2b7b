"""Tiny random models of the causal-LM families the backends are tested on, saved as `save_pretrained`
directories for `model.init_from`: hidden 64, 2 layers, 4 heads (2 kv heads where the family has them),
vocab 384 (the byte tokenizer needs 257 ids), 128 positions. Seeded: the same directory every time.

GPT-2's dropouts (0.1 by default) are set to 0 here, in the saved config.json, so that a training step is
a deterministic function of the weights and the batch (the plain-torch reference runs no dropout either);
`gpt2_with_dropout` keeps its defaults, for the context-parallel refusal. Mistral's sliding window (4096 by
default) is set to 32 (shorter than the tests' 64-token sequences), so it changes the attention.
"""
from __future__ import annotations

import pathlib

SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gpt2", "mixtral")
# Saved like a family (`saved`) for the expert-parallel meshes, but not in the families' matrix: Qwen3-MoE's experts
# are smaller than its dense MLP, with q/k norms, and flax does not build it.
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, head_dim=16, moe_intermediate_size=48)


def hf_config(family: str):
    """The transformers config of the tiny model of `family`."""
    from transformers import AutoConfig

    if family == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                    eos_token_id=None)
    extra = {"qwen2": dict(use_sliding_window=False), "mistral": dict(sliding_window=32),
             "gemma": dict(head_dim=16), "mixtral": dict(MOE, sliding_window=None),
             "qwen3_moe": QWEN3_MOE}.get(family, {})
    return AutoConfig.for_model(family, **SHAPE, **extra)


def save_model(family: str, directory: pathlib.Path, seed: int = 0, **overrides) -> pathlib.Path:
    """A seeded random model of `family` saved into `directory` (created); `overrides` set config fields."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return pathlib.Path(directory)


def gpt2_with_dropout(directory: pathlib.Path) -> pathlib.Path:
    """GPT-2 as its config ships: attention dropout 0.1."""
    return save_model("gpt2", directory, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)


STEPS = 5
RTOL = 1e-5  # fp32: the first STEPS losses against the plain-torch reference


def saved(tmp_path_factory, family: str) -> pathlib.Path:
    """The tiny `family` model in this test session's tmp directory (saved once)."""
    directory = tmp_path_factory.getbasetemp() / "families" / family
    return directory if (directory / "config.json").is_file() else save_model(family, directory)


def overrides(model_dir) -> dict:
    """The test recipe's settings for a family run: every step logged, no evaluation or checkpoint."""
    return {"model.init_from": str(model_dir), "train.steps": STEPS, "train.log_every": 1, "train.save_every": 0,
            "train.eval_every": 0}


def cli_args(model_dir, workdir, extra: dict | None = None) -> list:
    from tests.conftest import TEST_RECIPE

    settings = {**overrides(model_dir), **(extra or {})}
    return ["--config", TEST_RECIPE, "--workdir", str(workdir), *(f"--config.{k}={v}" for k, v in settings.items())]


def reference(model_dir) -> list:
    """The losses of STEPS steps of the single-process plain-torch loop (tests/parity/reference.py)."""
    from tests.parity.matrix import make_config
    from tests.parity.reference import reference_losses

    return reference_losses(make_config(overrides(model_dir)), STEPS)


def losses(workdir) -> list:
    from tests.conftest import read_metrics

    return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


def assert_trains_like_plain_torch(backend: str, model_dir, tmp_path, env: dict | None = None, *, nproc: int = 2,
                                   plan: dict | None = None) -> None:
    """`python -m portable_fsdp.run --backend BACKEND --nproc NPROC` on the model (with `plan` overrides, e.g.
    {"plan.ep_size": 2}): its first STEPS losses are the plain-torch reference's within RTOL."""
    from tests.conftest import cli
    from tests.parity.reference import max_relative_difference

    args = cli_args(model_dir, tmp_path / "run", plan)
    proc = cli(["--backend", backend, "--nproc", str(nproc), *args], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = losses(tmp_path / "run")
    assert len(trained) == STEPS
    assert max_relative_difference(trained, reference(model_dir)) <= RTOL
