"""Shared fixtures for ntx_system tests.

Makes `ntx_system` importable from the source tree when the project is not installed (the
venv used before `packaging/dev/bootstrap` runs)."""
import os
import sys

try:
    import ntx_system  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "system"))
