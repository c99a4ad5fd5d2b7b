"""examples/tpu/: each script's training command parses with our own command line, runs --backend xla on a recipe
variant that exists for its slice, and a slice of several hosts starts it on every host with a shared workdir."""
import importlib.util
import re
import shlex

import pytest

from portable_fsdp.run import parse_args
from tests.conftest import ROOT

EXAMPLES = ROOT / "examples" / "tpu"
# script: (the accelerator its recipe variant is for, how the command reaches every host: None on one host)
SCRIPTS = {"v5p-8.sh": ("v5p-8", None), "v5p-16.sh": ("v5p-16", "--worker=all"),
           "v5p-16-xpk.sh": ("v5p-16", "--tpu-type v5p-16")}
CHIPS = {"v5p-8": 4, "v5p-16": 8}  # a v5p-N has N TensorCores, two per chip


def launch_line(script: str) -> str:
    """The script's one command that starts the run (gcloud, xpk or python itself)."""
    lines = [line for line in (EXAMPLES / script).read_text().splitlines()
             if re.match(r"(gcloud|xpk|python) ", line)]
    assert len(lines) == 1, lines
    return lines[0]


def training_argv(line: str) -> list:
    """The `python -m portable_fsdp.run` arguments, from the line itself or from its --command "..." (run on each
    host after `cd`)."""
    words = shlex.split(line)
    if words[0] != "python":
        words = shlex.split(words[words.index("--command") + 1].split(";")[-1])
    assert words[:3] == ["python", "-m", "portable_fsdp.run"], words
    return words[3:]


def recipe_variants(path: str) -> dict:
    spec = importlib.util.spec_from_file_location("example_recipe", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VARIANTS


def test_every_script_is_checked():
    assert sorted(p.name for p in EXAMPLES.glob("*.sh")) == sorted(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_command_parses_and_names_a_variant_for_its_slice(script):
    accelerator, _ = SCRIPTS[script]
    args, overrides = parse_args(training_argv(launch_line(script)))
    assert args.backend == "xla" and overrides == []
    path, _, variant = args.config.partition(":")
    assert variant == accelerator
    chosen = recipe_variants(path)[variant]
    assert (chosen.backend, chosen.nproc) == ("xla", CHIPS[accelerator])


@pytest.mark.parametrize("script", [s for s, (_, every_host) in SCRIPTS.items() if every_host])
def test_a_slice_of_several_hosts_runs_everywhere_with_a_shared_workdir(script):
    line = launch_line(script)
    assert SCRIPTS[script][1] in line
    args, _ = parse_args(training_argv(line))
    assert args.workdir == "$WORKDIR"  # the script's argument, which its usage line asks to be a bucket
    assert "gs://BUCKET/RUN" in (EXAMPLES / script).read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_host_can_feed_the_plan_of_its_slice(script):
    """The recipe variant's resolved plan passes the check every host of the slice makes before torch_xla starts
    (a v5p-N slice has a host per 4 chips)."""
    from portable_fsdp.backends.xla.launch import check_slice_plan
    from portable_fsdp.config.schema import load_recipe
    from portable_fsdp.config.validate import resolve_plan

    args, _ = parse_args(training_argv(launch_line(script)))
    chips = CHIPS[SCRIPTS[script][0]]
    check_slice_plan(resolve_plan(load_recipe(str(ROOT / args.config)), chips), hosts=chips // 4)
