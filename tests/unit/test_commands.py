"""The `portable-fsdp` console script reaches each command's own main, and a base install (no extras) has every
package the default run imports."""
import os
import subprocess
import sys
import tomllib

import pytest

from portable_fsdp import commands
from tests.conftest import ROOT, TEST_RECIPE

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_console_script_is_the_dispatcher():
    assert PYPROJECT["project"]["scripts"]["portable-fsdp"] == "portable_fsdp.commands:main"


def test_help_lists_every_command(capsys):
    assert commands.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(name in usage for name in commands.COMMANDS)


def test_an_unknown_command_is_one_line(capsys):
    assert commands.main(["train"]) == 2
    assert capsys.readouterr().err == ("error: command line: unknown command 'train'; choose one of run, estimate, "
                                       "selftest, crosscheck, plot, convert\n")


@pytest.mark.parametrize("name", commands.COMMANDS)
def test_each_command_reaches_its_module(name, capsys):
    try:
        status = commands.main([name, "--help"])
    except SystemExit as exit_:  # argparse's --help; run returns the status instead
        status = exit_.code
    assert status == 0
    assert f"python -m portable_fsdp.{name}" in capsys.readouterr().out


# Runs the default job's code path (one short step) with every import a portable_fsdp module makes checked against
# the standard library and the base dependencies: an extra's package is refused, as on a base install.
BASE_INSTALL = r"""
import importlib.metadata, re, runpy, sys

distributions = importlib.metadata.packages_distributions()
base = {re.split(r"[<>=!~ ;\[]", requirement)[0].lower().replace("_", "-") for requirement in sys.argv[1].split("|")}
allowed = {name for name, dists in distributions.items() if any(d.lower().replace("_", "-") in base for d in dists)}
allowed |= set(sys.stdlib_module_names) | {"portable_fsdp"}

class BaseInstall:
    def find_spec(self, name, path=None, target=None):
        caller = sys._getframe(1)
        while caller and caller.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            caller = caller.f_back
        top = name.partition(".")[0]
        if caller and caller.f_globals.get("__name__", "").startswith("portable_fsdp") and top not in allowed:
            print(f"outside the base install: {top}", file=sys.stderr)
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        return None

sys.meta_path.insert(0, BaseInstall())
sys.argv = ["portable_fsdp.run", *sys.argv[2:]]
runpy.run_module("portable_fsdp.run", run_name="__main__", alter_sys=True)
"""


def test_the_default_run_needs_only_the_base_dependencies(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", BASE_INSTALL, "|".join(PYPROJECT["project"]["dependencies"]), "--config", TEST_RECIPE,
         "--workdir", str(tmp_path / "run"), "--nproc", "1", "--config.train.steps=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "outside the base install" not in proc.stderr and proc.returncode == 0, proc.stderr[-3000:]
