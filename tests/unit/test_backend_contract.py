"""Every registered backend implements the whole contract (portable_fsdp/backend.py `Backend`): each function,
with the contract's parameter names, kinds and defaults. A new backend is one folder plus its registry and
capability entries; this test is what tells it is complete."""
import json
import os
import subprocess
import sys

import pytest

from portable_fsdp.backend import contract_functions
from portable_fsdp.backends import BACKENDS
from tests.conftest import ROOT

PROBE = """
import importlib, inspect, json, sys
from portable_fsdp.backend import Backend, contract_functions

def shape(function, drop_self):
    params = list(inspect.signature(function).parameters.values())[1 if drop_self else 0:]
    return [[p.name, p.kind.name, repr(p.default)] for p in params]

found = {"contract": {n: shape(getattr(Backend, n), True) for n in contract_functions()}}
for module in sys.argv[1:]:
    backend = importlib.import_module(module)
    found[module] = {n: shape(getattr(backend, n), False) if callable(getattr(backend, n, None)) else None
                     for n in contract_functions()}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def signatures():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu", "USE_TORCH_XLA": "0"}
    modules = sorted(set(BACKENDS.values()))
    proc = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_contract_names_the_functions_the_loop_calls():
    assert {"init", "train_step", "eval_step", "predict_step", "count_label_tokens", "save_checkpoint",
            "load_checkpoint", "memory_report", "placement", "barrier", "any_rank", "model_info",
            "finalize", "describe_model", "export_weights"} <= set(contract_functions())


@pytest.mark.parametrize("module", sorted(set(BACKENDS.values())))
def test_backend_implements_the_whole_contract(signatures, module):
    contract, backend = signatures["contract"], signatures[module]
    missing = [name for name, found in backend.items() if found is None]
    assert not missing, f"{module} lacks {missing}"
    for name, expected in contract.items():
        assert backend[name] == expected, f"{module}.{name}{backend[name]} != contract {expected}"


def test_the_check_can_fail(signatures):
    # A function with another parameter name is caught (the comparison is not vacuous).
    contract = signatures["contract"]["eval_step"]
    assert [p[0] for p in contract] == ["state", "batch", "num_items_in_batch"]
