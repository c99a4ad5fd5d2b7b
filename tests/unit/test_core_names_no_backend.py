"""The core asks a backend through its module (the `Backend` contract) and never branches on its name: adding a
backend is adding a folder and a registry entry. Read from the source: no core module compares a backend name
with a registered one or imports a backend's package; the registry (portable_fsdp/backends/__init__.py) and the capability
table (whose columns are the backends) are where names live."""
import ast

import pytest

from portable_fsdp.backends import BACKENDS
from tests.conftest import ROOT

NAMES_LIVE_HERE = {"capabilities.py"}
BACKEND_PACKAGES = set(BACKENDS.values())


def core_modules():
    """Every module of the package but the backends' and the recipes' (user data)."""
    package = ROOT / "portable_fsdp"
    return sorted(p for p in package.rglob("*.py") if p.name not in NAMES_LIVE_HERE
                  and p.relative_to(package).parts[0] not in ("backends", "configs"))


def _constants(node) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_constants(e) for e in node.elts)) if node.elts else set()
    return set()


def _speaks_of_a_backend(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "backend" in name.lower()


def name_branches(source: str) -> list:
    """(line, text) of every comparison of a backend-named value with a registered backend name, and every import
    of a backend package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_speaks_of_a_backend, operands)) and set().union(*map(_constants, operands)) & set(BACKENDS):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom):
                modules += [f"{node.module}.{a.name}" for a in node.names]
            if any(m == p or m.startswith(p + ".") for m in modules for p in BACKEND_PACKAGES):
                found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_does_not_branch_on_a_backend_name(path):
    assert name_branches(path.read_text()) == []


def test_the_check_can_fail():
    source = 'if backend_name == "xla":\n    pass\nif target.backend in ("cpu", "cuda"):\n    pass\n' \
             'from portable_fsdp.backends.flax.devices import platform\n'
    assert sorted(line for line, _ in name_branches(source)) == [1, 3, 5]
    assert name_branches('if device == "cuda":\n    pass\nfrom portable_fsdp.backends.hf_torch import model\n') == []
