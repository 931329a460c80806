#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# libflashkda as FLA's flash_kda backend, on a GPU machine without network:
# installs FLA's ops package (fla-core) from the wheel in $FLA_WHEELS, runs
# FLA's FlashKDA backend tests with flashkda.compat registered as flash_kda,
# then times chunk_kda through the alias against FLA's Triton path
# (bench/fla_compat.py); first, flashkda.compat's own tests on the GPU.
# Results under $OUT: fla_tests.json, fla_timing.json, fla_compat.md (the
# summary) and the logs.
#
#   FLASHKDA_LIBRARY  the library (default build/libflashkda.so.0)
#   FLA_WHEELS        folder with fla_core-*.whl and FLA's test_kda.py (default .fla-wheels)
#   FLA_TEST_FILE     FLA's tests/ops/test_kda.py (default $FLA_WHEELS/test_kda.py)
#   FLA_CASES         timed cases (default P1,P11; see bench/fla_compat.py)
#   OUT               results folder (default ./fla_compat_out)
set -uo pipefail
cd "$(dirname "$0")/.."

export FLASHKDA_LIBRARY="$(realpath "${FLASHKDA_LIBRARY:-build/libflashkda.so.0}")"
FLA_WHEELS="${FLA_WHEELS:-.fla-wheels}"
FLA_TEST_FILE="${FLA_TEST_FILE:-$FLA_WHEELS/test_kda.py}"
OUT="${OUT:-$PWD/fla_compat_out}"
mkdir -p "$OUT"
python="${PYTHON:-python3}"

site="$(mktemp -d)"
if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$FLA_WHEELS"/fla_core-*.whl >"$OUT/install.log" 2>&1; then
  cat "$OUT/install.log"; exit 1
fi
export PYTHONPATH="$site:$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# FLA's other dependency; the image is expected to have it.
"$python" -c "import einops, triton, torch; assert torch.cuda.is_available(), 'no CUDA device'" \
  || exit 1

status=0
# flashkda.compat's own tests, here with CUDA tensors and the GPU backend's sizing too.
"$python" -m pytest -q -rs -p no:cacheprovider bindings/python/tests/test_compat.py \
  2>&1 | tee "$OUT/compat_tests.log" || status=1
"$python" bench/fla_compat.py tests --test-file "$FLA_TEST_FILE" --out "$OUT" \
  2>&1 | tee "$OUT/tests.log" || status=1
"$python" bench/fla_compat.py time --cases "${FLA_CASES:-P1,P11}" --out "$OUT" \
  2>&1 | tee "$OUT/timing.log" || status=1
"$python" bench/fla_compat.py summary --out "$OUT"
exit $status
