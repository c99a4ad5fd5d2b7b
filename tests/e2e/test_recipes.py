"""The big-model recipes (portable_fsdp/configs/llama3_8b.py, qwen2_5_7b.py, qwen3_30b_a3b.py): every variant passes start-up
validation on the backend and process count it is written for, its model has the real model's size, and its
`smoke` variant — the same architecture at CPU size — trains end to end on every backend that honours it (each
recipe and each backend once by default, the whole grid under `slow`)."""
import importlib
import math

import pytest

from portable_fsdp import api, capabilities
from portable_fsdp.backends.hf_torch.model import describe_model
from portable_fsdp.config.schema import load_recipe
from portable_fsdp.configs.hardware import SMOKE_LAUNCH
from portable_fsdp.config.validate import capability_context, plan_from_config
from tests.conftest import ROOT, cli, read_metrics

RECIPES = {"llama3_8b": 8.03e9, "qwen2_5_7b": 7.62e9, "qwen3_30b_a3b": 30.5e9}


def variants(recipe: str) -> dict:
    return importlib.import_module(f"portable_fsdp.configs.{recipe}").VARIANTS


def spec(recipe: str, variant: str) -> str:
    return str(ROOT / "portable_fsdp" / "configs" / f"{recipe}.py") + f":{variant}"


@pytest.mark.parametrize("recipe, variant", [(r, v) for r in RECIPES for v in variants(r)])
def test_every_variant_passes_start_up_on_its_machine(recipe, variant):
    launch = variants(recipe)[variant]
    config = load_recipe(spec(recipe, variant))
    plan = api.plan_for(config, launch.nproc, backend=launch.backend)  # the capability table and the mesh checks
    assert math.prod(size for _, size in plan.mesh.axes()) == launch.nproc
    assert describe_model(config).n_params == pytest.approx(RECIPES[recipe], rel=0.01)
    assert config.plan.param_dtype == "bfloat16" and config.plan.reduce_dtype == "float32"


def test_an_unknown_variant_is_one_line(tmp_path):
    proc = cli(["--config", spec("llama3_8b", "8xa100"), "--workdir", str(tmp_path / "w")], cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "w").exists()
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "get_config('8xa100') failed: unknown variant '8xa100'; choose one of 8xh100, 1xh200, v5p-8, smoke")


def honours(recipe: str, backend: str) -> bool:
    config = load_recipe(spec(recipe, "smoke"))
    plan = plan_from_config(config)
    context = capability_context(config, plan, "cpu", SMOKE_LAUNCH.nproc, describe_model(config))
    return not any(isinstance(verdict, capabilities.Refused)
                   for _, verdict in capabilities.verdicts(context, capabilities.target_for(backend)))


# The default suite trains each recipe once and each backend once; the rest of the grid is slow.
DEFAULT = {("llama3_8b", "flax"), ("qwen2_5_7b", "xla"), ("qwen3_30b_a3b", "cpu")}


@pytest.mark.parametrize("recipe, backend", [
    pytest.param(r, b, marks=() if (r, b) in DEFAULT else pytest.mark.slow)
    for r in RECIPES for b in ("cpu", "xla", "flax") if honours(r, b)])
def test_the_smoke_variant_trains_end_to_end(recipe, backend, tmp_path):
    workdir = tmp_path / "run"
    proc = cli(["--config", spec(recipe, "smoke"), "--workdir", str(workdir), "--backend", backend,
                "--nproc", str(SMOKE_LAUNCH.nproc)], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(workdir) if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_the_readme_shows_the_command_of_every_variant():
    readme = (ROOT / "README.md").read_text()
    for recipe in RECIPES:
        for name, launch in variants(recipe).items():
            assert launch.command(recipe, name) in readme, (recipe, name)
