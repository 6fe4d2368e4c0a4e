"""Who may import whom, beyond "no circles" (tests/test_import_cycles.py).

Between the packages: the API package ntx_proto imports no other package of the project; the
daemon (ntransformerd) imports the API from ntx_proto, never the client library ntx_client; and
the engine opens no device, so engine/ imports nothing of ntx_system (the daemon brings the NVMe
drive up and hands its engine the opened source).

Inside the engine, its folders keep to their sides (engine/runtime/devices.py): tiers/ (the planner and
the streams) never imports a backend, and a backend never imports a private name of tiers/. What
the two sides share is declared in engine/runtime/devices.py (the Backend, Ops, Weights and KV
protocols); what a backend needs from the planner (a plan, a storage source) is handed over by
the engine.

Every import is read with `ast`, at any depth: inside functions and under `if TYPE_CHECKING:`
too, since a hidden import is still a dependency.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
ENGINE = os.path.join(ROOT, "daemon", "ntransformerd", "engine")
TIERS, BACKENDS = "ntransformerd.engine.tiers", "ntransformerd.engine.backends"
PACKAGES = {"ntransformerd": "daemon", "ntx_client": "client", "ntx_system": "system", "ntx_proto": "proto"}
# (importer, imported, why not): a module inside the first package imports nothing inside the second
FORBIDDEN = (
    ("ntx_proto", "ntransformerd", "the API package stands alone: every program and service links it"),
    ("ntx_proto", "ntx_client", "the API package stands alone: every program and service links it"),
    ("ntx_proto", "ntx_system", "the API package stands alone: every program and service links it"),
    ("ntransformerd", "ntx_client", "the daemon takes the API from ntx_proto, not from the client library"),
    ("ntransformerd.engine", "ntx_system", "the engine opens no device: the daemon hands it the opened drive"),
)
# Modules allowed one forbidden import, each with its reason (none today: ntx-model and ntx-client
# share their command-line pieces through ntx_proto.cli).
ALLOWED: dict[tuple[str, str], str] = {}


def _module_of(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    return ".".join(["ntransformerd", "engine"] + (rel[:-1] if rel[-1] == "__init__" else rel))


def imports(path: str, module: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module imported, names taken from it) for every import in the file; relative
    imports resolved against `module` (the file's own dotted name)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[:len(package) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((node.lineno, base, tuple(a.name for a in node.names)))
    return out


def _files(folder: str):
    for d, dirs, files in os.walk(folder):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(root: str = ENGINE) -> list[str]:
    """Each import that breaks a rule, as 'file:line: what'."""
    bad = []
    for path in _files(os.path.join(root, "tiers")):
        for line, mod, names in imports(path, _module_of(path, root)):
            hit = [t for t in [mod] + [f"{mod}.{n}" for n in names] if _within(t, BACKENDS)]
            if hit:
                bad.append(f"{os.path.relpath(path, root)}:{line}: tiers/ imports the backend {hit[0]}")
    for path in _files(os.path.join(root, "backends")):
        for line, mod, names in imports(path, _module_of(path, root)):
            if not _within(mod, TIERS) and not any(_within(f"{mod}.{n}", TIERS) for n in names):
                continue
            private = [p for p in mod.split(".") if p.startswith("_") and p != "__init__"]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{os.path.relpath(path, root)}:{line}: a backend imports tiers' private "
                           f"{', '.join(private)} (from {mod})")
    return bad


def test_tiers_and_backends_keep_to_their_sides():
    bad = violations()
    assert not bad, "\n".join(bad)


def test_the_rules_catch_each_kind_of_violation(tmp_path):
    """A fake engine tree with one violation of each kind, at module level, inside a function,
    relative and absolute: each is reported, and the allowed imports are not."""
    root = tmp_path / "engine"
    (root / "tiers").mkdir(parents=True)
    (root / "backends" / "gpu").mkdir(parents=True)
    (root / "tiers" / "__init__.py").write_text("from ntransformerd.engine.tiers.planner import Plan\n")
    (root / "tiers" / "planner.py").write_text(
        "import numpy as np\n"
        "from ntransformerd.engine import devices\n"
        "def f():\n"
        "    from ntransformerd.engine.backends import cpu\n")  # line 4: a backend, hidden in a function
    (root / "tiers" / "stream.py").write_text("from ..backends.gpu import weights\n")  # line 1: relative
    (root / "tiers" / "other.py").write_text("from ntransformerd.engine import backends\n")  # line 1: the registry
    (root / "backends" / "gpu" / "weights.py").write_text(
        "from ntransformerd.engine.tiers.layer_stream import LayerStream\n"  # public: allowed
        "from ntransformerd.engine.tiers.planner import VRAM, _int\n"  # line 2: a private name
        "from ntransformerd.engine.tiers import _helpers\n"  # line 3: a private module
        "from ...tiers.sources import _align\n")  # line 4: relative, private
    got = sorted(violations(str(root)))
    assert got == sorted([
        "backends/gpu/weights.py:2: a backend imports tiers' private _int (from ntransformerd.engine.tiers.planner)",
        "backends/gpu/weights.py:3: a backend imports tiers' private _helpers (from ntransformerd.engine.tiers)",
        "backends/gpu/weights.py:4: a backend imports tiers' private _align (from ntransformerd.engine.tiers.sources)",
        "tiers/other.py:1: tiers/ imports the backend ntransformerd.engine.backends",
        "tiers/planner.py:4: tiers/ imports the backend ntransformerd.engine.backends",
        "tiers/stream.py:1: tiers/ imports the backend ntransformerd.engine.backends.gpu",
    ]), got


# ---- between the packages ------------------------------------------------------------------------

def _package_modules(root: str) -> dict[str, str]:
    """module name → path for every .py of the packages under `root` (generated stubs included:
    they import too)."""
    out = {}
    for pkg, top in PACKAGES.items():
        base = os.path.join(root, top)
        for path in _files(os.path.join(base, pkg)):
            rel = os.path.relpath(path, base)[:-3].split(os.sep)
            out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


def package_violations(root: str = ROOT) -> list[str]:
    """Each import across packages that FORBIDDEN names and ALLOWED does not, as
    'path:line: module imports target: why'."""
    bad = []
    for module, path in sorted(_package_modules(root).items()):
        for line, mod, names in imports(path, module):
            for importer, imported, why in FORBIDDEN:
                if not _within(module, importer) or (module, imported) in ALLOWED:
                    continue
                hit = [t for t in [mod] + [f"{mod}.{n}" for n in names] if _within(t, imported)]
                if hit:
                    bad.append(f"{os.path.relpath(path, root)}:{line}: {module} imports {hit[0]}: {why}")
    return bad


def test_packages_keep_to_their_floors():
    bad = package_violations()
    assert not bad, "\n".join(bad)


def test_the_package_rules_catch_each_kind(tmp_path):
    """A fake tree with one forbidden import of each kind (absolute, relative, from a package,
    inside a function): each is reported, the allowed ones are not."""
    files = {
        "daemon/ntransformerd/__init__.py": "",
        "daemon/ntransformerd/server/servicer.py": "from ntx_client.client import piece_text\n"  # 1
                                                   "from ntx_proto.wire import FIELD_METADATA\n",
        "daemon/ntransformerd/server/daemon.py": "import ntx_client\n",  # line 1
        "daemon/ntransformerd/engine/__init__.py": "",
        "daemon/ntransformerd/engine/tiers.py": "def f():\n    from ntx_system import source\n",  # line 2
        "daemon/ntransformerd/server/storage.py": "from ntx_system.source import NvmeStagedSource\n",  # allowed
        "daemon/ntransformerd/tools/ntx_model.py": "from ntx_client.cli import StatusLine\n",  # line 1
        "proto/ntx_proto/__init__.py": "",
        "proto/ntx_proto/paths.py": "from ntx_client import errors\n",  # line 1
        "client/ntx_client/__init__.py": "from ntx_proto import paths\n",
        "system/ntx_system/admin.py": "from ntx_client import Client\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = [line.split(": ")[0] + ": " + line.split(": ")[1] for line in package_violations(str(tmp_path))]
    assert got == [
        "daemon/ntransformerd/engine/tiers.py:2: ntransformerd.engine.tiers imports ntx_system",
        "daemon/ntransformerd/server/daemon.py:1: ntransformerd.server.daemon imports ntx_client",
        "daemon/ntransformerd/server/servicer.py:1: ntransformerd.server.servicer imports ntx_client.client",
        "daemon/ntransformerd/tools/ntx_model.py:1: ntransformerd.tools.ntx_model imports ntx_client.cli",
        "proto/ntx_proto/paths.py:1: ntx_proto.paths imports ntx_client",
    ], got


def test_the_engine_is_grouped_by_what_it_does():
    """engine/ holds its groups (runtime/, generation/, calibration/, and the runtime's backends/
    and tiers/) and the GGUF reader; a new module goes into the group of what it does."""
    top = sorted(f for f in os.listdir(ENGINE) if f.endswith(".py"))
    groups = sorted(d for d in os.listdir(ENGINE) if os.path.isfile(os.path.join(ENGINE, d, "__init__.py")))
    assert top == ["__init__.py", "gguf_file.py", "quants.py"], top
    assert groups == ["backends", "calibration", "generation", "runtime", "tiers"], groups
