#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Loads the built library under an older Debian's glibc (bullseye: 2.31) and
# runs a CPU forward pass there through the C ABI; its checksum must equal the
# one under this machine's glibc. The CTest old_glibc runs it (it downloads
# two packages from the Debian mirror that this machine's apt uses).
#
#   scripts/old-glibc-check.sh [BUILD_DIR] [SUITE]     (defaults: build, bullseye)
#
# Only that suite's libc6 and libgcc-s1 are fetched (apt-get download with
# apt state of its own under BUILD_DIR/old-glibc) and run through their own
# dynamic loader; nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(cd "${1:-build}" && pwd)
suite=${2:-bullseye}
work="$build/old-glibc"
rm -rf "$work"
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/root"

mirror=$(sed -nE 's/^URIs: *([^ ]+).*/\1/p; s/^deb +(\[[^]]*\] +)?([^ ]+) .*/\2/p' \
           /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v security | head -n 1 || true)
[ -n "$mirror" ] || { echo "old-glibc-check: no Debian mirror in this machine's apt sources" >&2; exit 1; }
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" >"$work/apt/sources.list"
apt=(apt-get -q -o "Dir::Etc::SourceList=$work/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache")
"${apt[@]}" update
(cd "$work" && "${apt[@]}" download "libc6/$suite" "libgcc-s1/$suite")
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
loader=$(find "$work/root" -name 'ld-*.so*' -type f | head -n 1)

# The program needs no more than the library does (tests/old_glibc/start_main.c).
cc -std=c99 -O2 -Iinclude tests/old_glibc/cpu_forward.c tests/old_glibc/start_main.c \
   -Wl,--wrap=__libc_start_main -L"$build" -l:libflashkda.so.0 -lm -o "$work/cpu_forward"

here=$(LD_LIBRARY_PATH="$build" "$work/cpu_forward")
there=$("$loader" --library-path "$work/root/lib/x86_64-linux-gnu:$build" "$work/cpu_forward")
echo "here:  $here"
echo "there: $there"
[ "${here#*: }" = "${there#*: }" ] || { echo "old-glibc-check: the checksums differ" >&2; exit 1; }
[ "${here%%:*}" != "${there%%:*}" ] || { echo "old-glibc-check: both ran on the same glibc" >&2; exit 1; }
echo "old-glibc-check: libflashkda loads and computes the same under ${there%%:*}"
