"""Importing the xla backend imports no torch_xla (the launcher must set torch_xla's environment first); that
it offers the whole contract: tests/unit/test_backend_contract.py."""
import json
import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import json, sys
import portable_fsdp.backends.torch as torch_backend
import portable_fsdp.backends.xla as xla_backend
print(json.dumps({"torch": sorted(torch_backend.__all__), "xla": sorted(xla_backend.__all__),
                  "torch_xla_imported": any(m.split(".")[0] == "torch_xla" for m in sys.modules)}))
"""


def test_xla_backend_imports_torch_xla_lazily():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not found["torch_xla_imported"]
