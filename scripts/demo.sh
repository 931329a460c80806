#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds the library and runs fkda-demo: the forward pass on an embedded
# case, on the GPU when one is usable, else on the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target fkda-demo
build/examples/fkda-demo "$@"
