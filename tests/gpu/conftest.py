"""GPU tests: every module here is marked `gpu` and skipped cleanly where CuPy is missing or
sees no device (CI). Makes `ntransformerd` importable from the source tree."""
import os
import sys

import pytest

try:
    import ntransformerd  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "daemon"))


def _gpu_reason():
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # no driver
        return f"no CUDA device ({e.__class__.__name__})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
