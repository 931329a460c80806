# SPDX-License-Identifier: MIT
"""Finding and loading libflashkda.

Search order: an explicit path given to load_library(), then the
FLASHKDA_LIBRARY environment variable, then a copy bundled inside this
package (wheels carry one), then the system loader (libflashkda.so.0).
"""

import ctypes
import os
import threading

from . import _abi
from ._errors import FlashKDAError

LIBRARY_ENV = "FLASHKDA_LIBRARY"
SONAME = "libflashkda.so.0"
BUNDLED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), SONAME)


class Library:
    """A loaded libflashkda with typed entry points."""

    def __init__(self, cdll, path):
        self.cdll = cdll
        self.path = path

    def check(self, status):
        """Turns a non-zero fkda_status into FlashKDAError."""
        if status != _abi.Status.SUCCESS:
            message = self.cdll.fkda_last_error()
            text = self.cdll.fkda_status_string(status)
            raise FlashKDAError(
                status,
                message.decode("utf-8", "replace") if message else "",
                text.decode("utf-8", "replace") if text else None,
            )


_lock = threading.Lock()
_current = None


def _open(path, origin):
    try:
        cdll = ctypes.CDLL(path)
    except OSError as error:
        raise FlashKDAError(None, f"library: cannot load {path} ({origin}): {error}") from None
    try:
        _abi.declare(cdll)
    except AttributeError as error:
        raise FlashKDAError(
            None, f"library: {path} ({origin}) lacks an fkda_* function: {error}"
        ) from None
    return Library(cdll, path)


def _open_explicit(path, origin):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FlashKDAError(None, f"library: {path} ({origin}) does not exist")
    return _open(os.path.abspath(path), origin)


def load_library(path=None):
    """Loads libflashkda and makes it the one new plans and calls use.

    With `path` None this follows the search order of the module docstring.
    Plans keep the library they were created with.
    """
    global _current
    with _lock:
        if path is not None:
            _current = _open_explicit(path, "path given to load_library")
            return _current
        from_env = os.environ.get(LIBRARY_ENV)
        if from_env:
            _current = _open_explicit(from_env, f"from {LIBRARY_ENV}")
        elif os.path.exists(BUNDLED_PATH):
            _current = _open(BUNDLED_PATH, "bundled with the package")
        else:
            try:
                _current = _open(SONAME, "system loader")
            except FlashKDAError as error:
                raise FlashKDAError(
                    None,
                    f"library: libflashkda not found: set {LIBRARY_ENV} to the path of "
                    f"{SONAME}, call flashkda.load_library(path), or install it where the "
                    f"system loader finds it ({error.message})",
                ) from None
        return _current


def library():
    """The loaded library, loading it on first use."""
    current = _current
    if current is not None:
        return current
    return load_library()


def library_path():
    """The path of the library in use (loading it if needed)."""
    return library().path
