"""The neutral core imports no framework: `--backend cpu` never pays for jax, and unit tests stay fast."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

NEUTRAL = ["portable_fsdp.plan", "portable_fsdp.config", "portable_fsdp.validate", "portable_fsdp.hf_import",
           "portable_fsdp.data.loader", "portable_fsdp.loop", "portable_fsdp.evaluation",
           "portable_fsdp.checkpointing", "portable_fsdp.schedule", "portable_fsdp.metrics"]
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "torch_xla", "tensorflow")

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
frameworks = {frameworks!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in frameworks)))
"""


def imported_frameworks(modules):
    code = PROBE.format(modules=modules, frameworks=FRAMEWORKS)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_neutral_core_imports_no_framework():
    assert imported_frameworks(NEUTRAL) == "[]"


@pytest.mark.parametrize("module", ["portable_fsdp.loop", "portable_fsdp.hf_import", "portable_fsdp.validate"])
def test_each_module_alone_imports_no_framework(module):
    assert imported_frameworks([module]) == "[]"


def test_probe_detects_a_framework():
    # The check itself must be able to fail: importing torch is seen.
    assert "torch" in imported_frameworks(["portable_fsdp.plan", "torch"])
