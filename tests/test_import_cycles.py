"""No import cycles among the project's modules: every `import` and `from … import` (at module
level or inside a function) of ntransformerd, ntx_client and ntx_system, as an edge from the
importing module to the module it names (`from a.b import c` names a.b.c where that is a module,
else a.b). A package's own __init__ is a module like the others; imports under
`if TYPE_CHECKING:` (annotations only) are not run and not counted."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGES = {"ntransformerd": "daemon", "ntx_client": "client", "ntx_system": "system"}


def _modules() -> dict[str, str]:
    """module name → path, for every .py of the packages (generated stubs left out)."""
    out = {}
    for pkg, top in PACKAGES.items():
        base = os.path.join(ROOT, top)
        for d, dirs, files in os.walk(os.path.join(base, pkg)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "proto")]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), base)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(d, f)
    return out


def _edges(mods: dict[str, str]) -> dict[str, set[str]]:
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: not imported at run time
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    parts = m.split(".") if is_pkg else m.split(".")[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                if n in mods and n != m:
                    graph[m].add(n)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_is_read():
    graph = _edges(_modules())
    assert "ntransformerd.engine.model" in graph["ntransformerd.engine.backends.cuda.graphs"]
    assert "ntransformerd.engine.tiers.planner" in graph["ntransformerd.engine.tiers"]


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = _cycle(_edges(_modules()))
    assert cycle is None, " → ".join(cycle)
