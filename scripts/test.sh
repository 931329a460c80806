#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds everything and runs every test (C++, Python, Rust, Julia checker).
# [gpu] tests run when a usable GPU is present and are reported as skipped otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure
