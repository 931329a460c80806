# SPDX-License-Identifier: MIT
import os
import sys
import threading
import zlib

import numpy as np
import pytest

PYTHON_BINDINGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPOSITORY = os.path.dirname(os.path.dirname(PYTHON_BINDINGS))

# Running `pytest bindings/python/tests` straight from a checkout works too.
if PYTHON_BINDINGS not in sys.path:
    sys.path.insert(0, PYTHON_BINDINGS)

from flashkda import _api, _launch  # noqa: E402


def pytest_report_header(config):
    library = os.environ.get("FLASHKDA_LIBRARY", "(unset: bundled copy or system loader)")
    return f"FLASHKDA_LIBRARY: {library}"


@pytest.fixture
def rng(request):
    # A different, reproducible stream per test.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def header_path():
    include_dir = os.environ.get("FLASHKDA_INCLUDE_DIR", os.path.join(REPOSITORY, "include"))
    return os.path.join(include_dir, "flashkda.h")


@pytest.fixture
def block_builds(monkeypatch):
    """Counts the argument blocks built from now on, starting with no block
    cached for flashkda.fwd and flashkda.decode (earlier tests leave theirs)."""
    monkeypatch.setattr(_api, "_derived_blocks", threading.local())
    built = []
    original = _launch.ArgumentBlock.__init__

    def counting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(_launch.ArgumentBlock, "__init__", counting)
    return built
