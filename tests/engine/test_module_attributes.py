"""Every `module.name` the daemon's code reads off a project module it imported names something
that module has. The CUDA backend's modules run only beside a GPU, so a name left behind when a
function moved between them (launch.attention_decode_ after the attention launchers moved to
attention.py) failed every GPU step while every CPU test passed; this reads the code instead."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "daemon")


def _modules():
    for d, dirs, files in os.walk(os.path.join(ROOT, "ntransformerd")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name → project module, for `import ntransformerd.x as y` and `from ntransformerd.x import y`
    where y is a module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ntransformerd.") and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ntransformerd") and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    if importlib.util.find_spec(full) is not None:
                        out[a.asname or a.name] = full
                except (ImportError, ValueError):  # a name, not a module
                    continue
    return out


def _reads(path: str) -> list[tuple[int, str, str]]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    aliases = _module_aliases(tree)
    return [(n.lineno, aliases[n.value.id], n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
            and isinstance(n.ctx, ast.Load)]


def test_every_name_read_off_a_project_module_exists():
    missing = []
    for path in _modules():
        for line, module, name in _reads(path):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:  # an optional extra (systemd, cupy's GPU-only pieces) not installed here
                if "ntransformerd" in str(e):
                    raise
                continue
            if not hasattr(mod, name):
                missing.append(f"{os.path.relpath(path, ROOT)}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


def test_a_name_left_behind_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from ntransformerd.engine.backends.cuda import launch as K\nK.attention_decode_\nK.matvec\n")
    got = [(module, name) for _, module, name in _reads(str(path))]
    assert got == [("ntransformerd.engine.backends.cuda.launch", "attention_decode_"),
                   ("ntransformerd.engine.backends.cuda.launch", "matvec")]
    mod = importlib.import_module("ntransformerd.engine.backends.cuda.launch")
    assert not hasattr(mod, "attention_decode_") and hasattr(mod, "matvec")
