"""The shape of the project's imports, for ntransformerd, ntx_client, ntx_system and ntx_proto.

No cycles: every `import` and `from … import` (at module level or inside a function) is an edge
from the importing module to the module it names (`from a.b import c` names a.b.c where that is a
module, else a.b). A package's own __init__ is a module like the others. Imports under
`if TYPE_CHECKING:` (annotations only) are not run, but a circle through them is still two
modules that each need the other to be read: they count too.

Dependencies visible: an import sits at module level, unless it must wait (an optional dependency
such as CuPy, systemd or the [openai] extra, or a side effect such as readline's); then the line
says why, `# lazy: REASON`. And every module imports on its own in a fresh interpreter without
CuPy: no cycle bites at import time, no optional dependency is needed at module level, and the
command-line tools start without the GPU backend or the constraint compiler.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGES = {"ntransformerd": "daemon", "ntx_client": "client", "ntx_system": "system", "ntx_proto": "proto"}
GENERATED = os.path.join("proto", "ntx_proto", "ntransformer")  # protoc's stubs (proto/generate.py)
LAZY = re.compile(r"#\s*lazy:\s*\S")  # the marker of an import that must wait, and its reason
EXEMPT: tuple[str, ...] = ()  # files whose function-level imports are not checked (none)
# What a command-line tool must start without (its --help stays quick): the GPU backend, the host
# kernels' native build, the constraint compiler.
NOT_AT_START = ("ntransformerd.engine.backends.cuda", "ntransformerd.engine.backends.host", "cupy", "llguidance")
CLI_MODULES = ("ntx_client", "ntx_client.cli", "ntransformerd.tools.ntx_model")


def _modules(root: str = ROOT) -> dict[str, str]:
    """module name → path, for every .py of the packages (generated stubs left out)."""
    out = {}
    for pkg, top in PACKAGES.items():
        base = os.path.join(root, top)
        for d, dirs, files in os.walk(os.path.join(base, pkg)):
            dirs[:] = [x for x in dirs if x != "__pycache__"
                       and os.path.relpath(os.path.join(d, x), root) != GENERATED]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), base)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(d, f)
    return out


def _edges(mods: dict[str, str], *, annotations: bool = False) -> dict[str, set[str]]:
    """module → the modules it imports; `annotations`: those under `if TYPE_CHECKING:` too."""
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only and not annotations:  # not imported at run time
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
    assert "ntransformerd.engine.runtime.model" in graph["ntransformerd.engine.backends.cuda.graphs"]
    assert "ntransformerd.engine.tiers.planner" in graph["ntransformerd.engine.tiers"]


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = _cycle(_edges(_modules(), annotations=True))
    assert cycle is None, " → ".join(cycle)


def test_annotation_imports_are_edges(tmp_path):
    """Two modules that need each other only for annotations are still a circle."""
    pkg = tmp_path / "system" / "ntx_system"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "facts.py").write_text("from .rule import judge\n")
    (pkg / "rule.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .facts import Record\n")
    mods = _modules(str(tmp_path))
    assert _cycle(_edges(mods)) is None
    assert _cycle(_edges(mods, annotations=True)) == ["ntx_system.facts", "ntx_system.rule", "ntx_system.facts"]


# ---- imports inside functions say why ------------------------------------------------------------

def unexplained_lazy_imports(root: str = ROOT, skip: tuple[str, ...] = EXEMPT) -> list[str]:
    """'path:line: statement' for every import inside a function (at any depth) whose lines carry
    no `# lazy: REASON`; paths relative to `root`, those starting with an entry of `skip` left out."""
    bad = []
    for path in sorted(_modules(root).values()):
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if rel.startswith(skip):
            continue
        with open(path) as f:
            text = f.read()
        lines = text.splitlines()

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    if not any(LAZY.search(line) for line in lines[child.lineno - 1:child.end_lineno]):
                        bad.append(f"{rel}:{child.lineno}: {lines[child.lineno - 1].strip()}")
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(text, path), False)
    return bad


def test_imports_inside_functions_say_why():
    bad = unexplained_lazy_imports()
    assert not bad, ("move these imports to the top of their module, or say on the line why one must wait "
                     "(`# lazy: optional, the [gpu] extra`):\n" + "\n".join(bad))


def test_the_lazy_rule_catches_each_kind(tmp_path):
    """A fake tree: imports inside a function, a method and a nested function, absolute and
    relative, one or several lines, with and without a reason; module level and TYPE_CHECKING
    imports are never flagged, nor the skipped files."""
    pkg = tmp_path / "daemon" / "ntransformerd"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "skipped.py").write_text("def f():\n    import json\n")
    (pkg / "a.py").write_text(
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ntransformerd import b\n"
        "def f():\n"
        "    from ntransformerd import b\n"  # line 6: no reason
        "    import cupy  # lazy: optional, the [gpu] extra\n"
        "    from . import (  # lazy: the [openai] extra\n"
        "        b)\n"
        "    from .b import (x,\n"
        "                    y)\n"  # line 10: several lines, no reason
        "class C:\n"
        "    import json\n"  # a class body runs at import: not lazy
        "    def m(self):\n"
        "        import json  # lazy:\n"  # line 15: a marker with no reason
        "        def inner():\n"
        "            from ntransformerd.b import x\n")  # line 17
    (pkg / "b.py").write_text("x = y = 1\n")
    got = unexplained_lazy_imports(str(tmp_path), skip=("daemon/ntransformerd/engine/skipped.py",))
    assert got == ["daemon/ntransformerd/a.py:6: from ntransformerd import b",
                   "daemon/ntransformerd/a.py:10: from .b import (x,",
                   "daemon/ntransformerd/a.py:15: import json  # lazy:",
                   "daemon/ntransformerd/a.py:17: from ntransformerd.b import x"], got
    assert unexplained_lazy_imports(str(tmp_path), skip=())[-1] == "daemon/ntransformerd/engine/skipped.py:2: import json"


# ---- every module imports alone, in a fresh interpreter, without CuPy -------------------------------

_EACH_ALONE = r"""
import importlib, json, os, sys, traceback
sys.modules["cupy"] = sys.modules["cupyx"] = None  # CuPy absent (import raises), as on a host without a GPU
names, preload = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for m in preload:  # third-party only: no project cycle passes through them, and no child pays for them
    importlib.import_module(m)
before = set(sys.modules)
out = {}
for name in names:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # one child per module, forked before any project module is imported
        os.close(r)
        try:
            importlib.import_module(name)
            msg = {"loaded": sorted(set(sys.modules) - before)}
        except BaseException:
            msg = {"error": traceback.format_exc(limit=8)}
        with os.fdopen(w, "w") as f:
            json.dump(msg, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    out[name] = json.loads(text) if text else {"error": "the child exited without a report"}
json.dump(out, sys.stdout)
"""


def import_each_alone(names, paths, preload=("numpy", "gguf", "grpc")) -> dict[str, dict]:
    """{module: {"loaded": [modules it brought in]} or {"error": traceback}}: each module of
    `names` imported alone in a child of a fresh interpreter (sys.path: `paths` first) where
    CuPy cannot be imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _EACH_ALONE, json.dumps(list(names)), json.dumps(list(preload))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_every_module_imports_alone_without_cupy():
    got = import_each_alone(sorted(_modules()), [os.path.join(ROOT, top) for top in PACKAGES.values()])
    failed = {m: r["error"] for m, r in got.items() if "error" in r}
    assert not failed, "\n".join(f"{m}:\n{e}" for m, e in failed.items())
    for m in CLI_MODULES:
        heavy = [x for x in got[m]["loaded"] if x.split(".")[0] == "cupy" or x.startswith(NOT_AT_START)]
        assert not heavy, f"importing {m} loads {', '.join(heavy)}: keep it for when it is used (# lazy: …)"


def test_import_each_alone_finds_a_cycle_and_a_module_level_cupy(tmp_path):
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fakepkg.b import B\nA = 1\n")
    (pkg / "b.py").write_text("from fakepkg.a import A\nB = 2\n")
    (pkg / "gpu.py").write_text("import cupy\n")
    (pkg / "fine.py").write_text("import json\n")
    got = import_each_alone(["fakepkg.a", "fakepkg.b", "fakepkg.gpu", "fakepkg.fine"], [str(tmp_path)], preload=())
    assert "partially initialized module" in got["fakepkg.a"]["error"], got
    assert "partially initialized module" in got["fakepkg.b"]["error"], got
    assert "cupy" in got["fakepkg.gpu"]["error"], got
    assert got["fakepkg.fine"]["loaded"] == ["fakepkg", "fakepkg.fine"], got
