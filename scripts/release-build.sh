#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The release build: kernels whose machine code CUDA 12.9's ptxas assembled,
# so that every CUDA 12 driver (r525 and later) loads them, not only the CUDA
# 13 drivers (r580 and later) that this machine's CUDA 13 toolkit promises.
# The ptxas comes from PyPI's nvidia-cuda-nvcc-cu12 (which has no nvcc: the
# toolkit's nvcc writes the PTX), installed into .tools/cuda12. Builds the
# library, the GPU tests and fkda-bench (what scripts/gpu_check.sh runs), then
# lists the fatbin's images with cuobjdump (PyPI's nvidia-cuda-cuobjdump) and
# fails unless sm_80 and sm_90a are there.
#
#   scripts/release-build.sh [--library-only] [BUILD_DIR]      (default build-release)
#
# --library-only builds the library alone (what scripts/dist.sh packages).
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(flashkda fkda_gpu_tests fkda-bench)
if [ "${1:-}" = --library-only ]; then
  targets=(flashkda)
  shift
fi
build=${1:-build-release}
scripts/install-deps.sh
export PATH="$PATH:/usr/local/cuda/bin"

tools=.tools/cuda12
[ -x "$tools/bin/python" ] || /usr/bin/python3 -m venv "$tools"
"$tools/bin/python" -m pip install --quiet "nvidia-cuda-nvcc-cu12==12.9.*" "nvidia-cuda-cuobjdump"
site=$("$tools/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
cuobjdump=$(find "$site/nvidia" -name cuobjdump -type f | head -n 1)

# CUDA 12.9's ptxas knows PTX ISA 8.8 at most.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DFKDA_BUILD_BINDINGS_TESTS=OFF \
  -DFKDA_FATBIN_PTXAS="$ptxas" -DFKDA_FATBIN_PTX_ISA=8.8
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

images=$("$cuobjdump" --list-elf "$build/libflashkda.so")
echo "$images"
"$cuobjdump" --list-ptx "$build/libflashkda.so"
for arch in sm_80 sm_90a; do
  grep -q "$arch" <<<"$images" || { echo "release-build: no $arch image in $build/libflashkda.so" >&2; exit 1; }
done
