import os
import sys
import zlib

import numpy as np
import pytest

PYTHON_BINDINGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPOSITORY = os.path.dirname(os.path.dirname(PYTHON_BINDINGS))

# Running `pytest bindings/python/tests` straight from a checkout works too.
if PYTHON_BINDINGS not in sys.path:
    sys.path.insert(0, PYTHON_BINDINGS)


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
