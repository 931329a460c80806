#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The plain install tree of a configured and built tree (its runtime and dev
# components: CMAKE_INSTALL_LIBDIR, the .pc file that finds its prefix from
# its own location) as one archive, for RPM distributions or a private prefix:
#
#   scripts/make-tgz.sh BUILD_DIR OUT_DIR      (or: cmake --build BUILD_DIR --target tgz)
#
# writes OUT_DIR/flashkda-<version>-Linux.tar.gz. Only installs: unlike
# cpack, it never builds the tree's other targets first.
set -euo pipefail
build=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
# shellcheck source=/dev/null
source "$build/packaging/config.sh"
name=flashkda-$version-Linux
stage=$(mktemp -d "$build/packaging/tgz-XXXXXX")
trap 'rm -rf "$stage"' EXIT
umask 022
for component in runtime dev; do
  cmake --install "$build" --prefix "$stage/$name" --component "$component" >/dev/null
done
tar --sort=name --owner=0 --group=0 --numeric-owner -C "$stage" -czf "$out/$name.tar.gz" "$name"
echo "$out/$name.tar.gz"
