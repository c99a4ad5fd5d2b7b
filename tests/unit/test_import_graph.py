"""No import circle among the product's modules: every import (at the top of a module or inside a function, where
a circle only hides until the function runs) is an arrow, and the graph they draw has no cycle. Imports for type
checkers alone (`if TYPE_CHECKING:`) are not arrows: they never run."""
import ast

from tests.conftest import ROOT

def modules() -> dict:
    """{dotted module name: its source path}."""
    found = {}
    for path in (ROOT / "portable_fsdp").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_imports(tree) -> list:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def import_graph(sources: dict) -> dict:
    """{module: the product modules it imports} (`from a import b` is an arrow to a.b when that is a module,
    else to a). The top package is left out: its __init__ only names the API."""
    graph = {}
    for name, source in sources.items():
        arrows = set()
        for node in _runtime_imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            for target in targets:
                while target and target not in sources:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "portable_fsdp"):
                    arrows.add(target)
        graph[name] = arrows
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    graph = import_graph({name: path.read_text() for name, path in modules().items()})
    assert len(graph) > 100  # every module was read
    assert cycles(graph) == []


def test_the_check_finds_a_circle_and_ignores_type_only_imports():
    sources = {"portable_fsdp.a": "from portable_fsdp import b\n",
               "portable_fsdp.b": "def f():\n    from portable_fsdp.c import x\n",
               "portable_fsdp.c": "import portable_fsdp.a\n",
               "portable_fsdp.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from portable_fsdp import a\n",
               "portable_fsdp.e": "from portable_fsdp.d import y\n"}
    assert cycles(import_graph(sources)) == [["portable_fsdp.a", "portable_fsdp.b", "portable_fsdp.c"]]
