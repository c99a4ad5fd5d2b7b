"""The core package imports no framework at load: `--backend cpu` never pays for jax, `import portable_fsdp`
in a notebook stays light, and unit tests stay fast. Every module of portable_fsdp/ is checked, none excepted;
a module that needs a framework imports it inside the function that uses it."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "torch_xla", "tensorflow")

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
frameworks = {frameworks!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in frameworks)))
"""


def core_modules() -> list:
    """Every module under portable_fsdp/ but the backends' and the recipes' (portable_fsdp/backends/,
    portable_fsdp/configs/: not part of the core)."""
    names = []
    for path in sorted((ROOT / "portable_fsdp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[1] in ("backends", "configs"):
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_frameworks(modules):
    code = PROBE.format(modules=modules, frameworks=FRAMEWORKS)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_the_discovery_sees_the_whole_core():
    modules = core_modules()
    assert {"portable_fsdp", "portable_fsdp.training.loop", "portable_fsdp.launch.worker", "portable_fsdp.launch.launcher",
            "portable_fsdp.data.loader", "portable_fsdp.api"} <= set(modules)
    assert not any(m.startswith(("portable_fsdp.backends", "portable_fsdp.configs")) for m in modules)


def test_no_core_module_imports_a_framework():
    assert imported_frameworks(core_modules()) == "[]"


# Alone as well: what a user runs or imports first must load cleanly by itself (a circular import, for one,
# only shows when its module is imported first).
@pytest.mark.parametrize("module", ["portable_fsdp", "portable_fsdp.api", "portable_fsdp.run", "portable_fsdp.launch.launcher",
                                    "portable_fsdp.launch.worker", "portable_fsdp.crosscheck"])
def test_entry_points_alone_import_no_framework(module):
    assert imported_frameworks([module]) == "[]"


def test_probe_detects_a_framework():
    # The check itself must be able to fail: importing torch is seen.
    assert "torch" in imported_frameworks(["portable_fsdp.plan", "torch"])
