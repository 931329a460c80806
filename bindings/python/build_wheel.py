#!/usr/bin/env python3
"""Builds a wheel of the `flashkda` package with libflashkda bundled inside.

    python3 build_wheel.py --library build/libflashkda.so.0 --out dist/

The package sources are copied to a staging directory, the library is copied
into the staged flashkda/ as libflashkda.so.0, and pip builds the wheel from
there without network access (--no-build-isolation --no-deps), so the source
tree stays untouched. Needs pip, setuptools and wheel in this Python.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

PACKAGE_ROOT = os.path.dirname(os.path.abspath(__file__))
STAGED_FILES = ("pyproject.toml", "setup.py", "README.md")


def build_wheel(library, out_dir, python=sys.executable):
    """Returns the path of the wheel built into out_dir."""
    if not os.path.isfile(library):
        raise SystemExit(f"build_wheel.py: --library {library} is not a file")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flashkda-wheel-") as staging:
        for name in STAGED_FILES:
            shutil.copy2(os.path.join(PACKAGE_ROOT, name), staging)
        shutil.copytree(
            os.path.join(PACKAGE_ROOT, "flashkda"),
            os.path.join(staging, "flashkda"),
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "libflashkda.so*"),
        )
        # copyfile follows symlinks: the wheel gets the library itself.
        shutil.copyfile(library, os.path.join(staging, "flashkda", "libflashkda.so.0"))
        staged_dist = os.path.join(staging, "dist")
        subprocess.run(
            [python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
             "--no-cache-dir", "--no-index", "--quiet", "--wheel-dir", staged_dist, staging],
            check=True,
        )
        wheels = [name for name in os.listdir(staged_dist) if name.endswith(".whl")]
        if len(wheels) != 1:
            raise SystemExit(f"build_wheel.py: expected one wheel, pip produced {wheels}")
        destination = os.path.join(out_dir, wheels[0])
        shutil.copyfile(os.path.join(staged_dist, wheels[0]), destination)
    return destination


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", required=True, help="path to the built libflashkda.so.0")
    parser.add_argument("--out", required=True, help="directory that receives the wheel")
    args = parser.parse_args()
    print(build_wheel(args.library, args.out))


if __name__ == "__main__":
    main()
