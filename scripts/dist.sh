#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Every release artefact, from the release build (scripts/release-build.sh:
# kernels assembled by CUDA 12.9's ptxas, so any CUDA 12 driver loads them),
# into one folder:
#   flashkda-<version>-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
#   libflashkda0_<version>-<rev>_<arch>.deb, libflashkda-dev_<version>-<rev>_<arch>.deb
#   libflashkda.so.<version>.debug   (what the .deb's library is stripped of)
#   flashkda-<version>-Linux.tar.gz
# then checks that the library inside each package says CUDA 12.9 and driver
# floor 12000 (tests/consumer/check_release.cmake).
#
#   bash scripts/dist.sh [--build-dir DIR] [--out DIR]     (defaults: build-release, dist)
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-release
out=dist
while (($#)); do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "usage: scripts/dist.sh [--build-dir DIR] [--out DIR]" >&2; exit 2 ;;
  esac
done

bash scripts/release-build.sh --library-only "$build"
mkdir -p "$out"
# Only what this script writes is replaced: --out may name a folder with other files.
rm -f "$out"/flashkda-*.whl "$out"/libflashkda*.deb "$out"/libflashkda.so.*.debug "$out"/flashkda-*-Linux.tar.gz

bash scripts/make-debs.sh "$build" "$out"
bash scripts/make-tgz.sh "$build" "$out"
.tools/bin/python bindings/python/build_wheel.py --library "$build/libflashkda.so.0" --out "$out"

cmake -DDIST="$out" -DSOURCE_DIR="$PWD" -DWORK_DIR="$build/release-check" \
      -DCUDA_VERSION=12090 -DMIN_DRIVER_VERSION=12000 -P tests/consumer/check_release.cmake
ls -l "$out"
