# SPDX-License-Identifier: MIT
"""Only the wheel's platform tag lives here; the metadata is in pyproject.toml."""

import os

from setuptools import Distribution, setup

BUNDLED_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flashkda",
                               "libflashkda.so.0")


class DistributionWithLibrary(Distribution):
    """With libflashkda bundled the package is platform specific, though it
    has no extension module of its own."""

    def has_ext_modules(self):
        return os.path.exists(BUNDLED_LIBRARY)


command_classes = {}
try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # building an sdist only
    bdist_wheel = None

if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """ctypes needs no Python ABI: a platform wheel runs on any Python 3,
        hence py3-none-<platform> instead of cpXY-cpXY-<platform>."""

        def get_tag(self):
            python, abi, platform = super().get_tag()
            if not self.root_is_pure:
                python, abi = "py3", "none"
            return python, abi, platform

    command_classes["bdist_wheel"] = PlatformWheel

setup(distclass=DistributionWithLibrary, cmdclass=command_classes)
