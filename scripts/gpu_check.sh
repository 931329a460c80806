#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The GPU check, run on a machine with an NVIDIA GPU against a build made
# elsewhere (or here): the [gpu] tests, reruns under forced V splits and
# window sizes, compute-sanitizer (memcheck, racecheck, synccheck) on the
# [sanitize] set, the sm_80 code path through a PTX-only build, benchmarks.
#
#   scripts/gpu_check.sh [BUILD_DIR] [STEP...]
#
# BUILD_DIR defaults to build-gpu. STEPs (default: the first eight):
#   info tests vsplit window memcheck racecheck synccheck sm80_ptx
#   serving bench bench_f32 timing accuracy demo python sweep profile
#   build_info (the build's CUDA version and driver floor against the driver)
#   packaged (the release artefacts of scripts/dist.sh in $DIST, default dist:
#   the [gpu] tests on the .deb's library, flashkda.fwd on CUDA tensors from
#   the wheel; BUILD_DIR is the release build, for its fkda_gpu_tests)
# sm80_ptx runs the [gpu] tests of a second build whose fatbin holds only
# compute_80 PTX (the driver compiles it for this GPU, so the sm_80 code
# runs); it lives in $SM80_PTX_BUILD (default build-sm80-ptx), made with
#   cmake -S . -B build-sm80-ptx -DFKDA_FATBIN_ARCHS=compute_80
#   cmake --build build-sm80-ptx --target fkda_gpu_tests
# Logs go to $OUT (default ./gpu-check-logs); the last lines printed are a
# summary. The exit status is 0 only when every step passed: a failing,
# timed-out or skipped test run, a sanitizer report, a missing program or an
# unknown step makes it 1.
set -uo pipefail

build=${1:-build-gpu}
shift || true
steps=${*:-info tests vsplit window memcheck racecheck synccheck sm80_ptx}
sm80_build=${SM80_PTX_BUILD:-build-sm80-ptx}
out=${OUT:-$PWD/gpu-check-logs}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
# The project's virtual environment (scripts/install-deps.sh) where there is
# one, else the python3 on PATH (a GPU machine with its own torch).
python=python3
[ -x "$PWD/.tools/bin/python" ] && python="$PWD/.tools/bin/python"
tests="$build/tests/fkda_gpu_tests"
summary="$out/summary.txt"
: >"$summary"
failed=()

note() { echo "$*" | tee -a "$summary"; }

failure() {
  failed+=("$1")
  note "FAILED     $1: $2"
}

# Runs a step under a time limit with the library of `lib_dir`, records its
# exit status and Catch2's totals. Catch2 is told that matching no test is
# a failure.
step_in() {
  local lib_dir=$1 name=$2 limit=$3 log=$4
  shift 4
  local start=$SECONDS
  echo "=== $name: $*" >>"$log"
  LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local totals
  totals=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
  note "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - start)) "$totals")"
  if [ "$rc" -ne 0 ]; then
    case $rc in
      124) failure "$name" "timed out after ${limit}s (see $(basename "$log"))" ;;
      77) failure "$name" "skipped: no usable GPU (see $(basename "$log"))" ;;
      *) failure "$name" "exit status $rc (see $(basename "$log"))" ;;
    esac
  fi
}

step() { step_in "$(cd "$build" && pwd)" "$@"; }

# A program a step needs; its absence fails the step.
require() {
  if [ ! -x "$2" ]; then
    failure "$1" "$2 is missing (not built?)"
    return 1
  fi
}

sanitize() {
  local tool=$1
  shift
  require "$tool" "$tests" || return
  step "$tool" 300 "$out/$tool.log" compute-sanitizer --tool "$tool" "$@" --error-exitcode 3 \
    "$tests" "[sanitize]" --warn NoTests
}

for s in $steps; do
  case $s in
    info)
      {
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
        echo "--- cuobjdump --list-elf libflashkda.so"
        cuobjdump --list-elf "$build/libflashkda.so"
        echo "--- cuobjdump --list-ptx libflashkda.so"
        cuobjdump --list-ptx "$build/libflashkda.so"
        python3 -c "import sys; f, so = (open(x, 'rb').read() for x in sys.argv[1:]); print('library embeds this fatbin:', f in so)" \
          "$build/flashkda_kernels.fatbin" "$build/libflashkda.so"
        for arch in sm_80 sm_90a; do
          echo "--- SASS opcode counts, $arch"
          cuobjdump -sass -arch "$arch" "$build/flashkda_kernels.fatbin" |
            grep -oE "(HMMA|LDSM|LDGSTS|LDL|STL|MUFU\.EX2|BAR\.SYNC)[.0-9A-Z]*" | sort | uniq -c
          echo "--- resource usage, $arch"
          cuobjdump -res-usage -arch "$arch" "$build/flashkda_kernels.fatbin" | grep -A1 "Function"
        done
        echo "--- SASS, sm_90a"
        cuobjdump -sass -arch sm_90a "$build/flashkda_kernels.fatbin"
      } >"$out/info.txt" 2>&1
      elf=$(grep -c ELF "$out/info.txt")
      note "info       $elf ELF lines; see info.txt"
      [ "$elf" -gt 0 ] || failure info "cuobjdump lists no ELF in $build/libflashkda.so"
      ;;
    tests)
      require tests "$tests" && step tests 300 "$out/tests.log" "$tests" "[gpu]" --durations yes --warn NoTests
      ;;
    vsplit)
      # The [vsplit] tests leave the V split to the environment.
      require vsplit "$tests" || continue
      for v in 1 2 4 8; do
        step "vsplit=$v" 90 "$out/vsplit.log" env FKDA_VSPLIT=$v "$tests" "[vsplit]" --warn NoTests
      done
      ;;
    window)
      # Small forced windows put window boundaries inside, at the ends of and
      # between sequences of the [window] tests, so that states cross many.
      require window "$tests" || continue
      for w in 1 3 7; do
        step "window=$w" 150 "$out/window.log" env FKDA_WINDOW_SLOTS=$w "$tests" "[window]" --warn NoTests
      done
      ;;
    memcheck)
      sanitize memcheck
      ;;
    racecheck)
      sanitize racecheck --racecheck-report all
      ;;
    synccheck)
      sanitize synccheck
      ;;
    sm80_ptx)
      sm80_tests="$sm80_build/tests/fkda_gpu_tests"
      require sm80_ptx "$sm80_tests" || continue
      sm80_dir=$(cd "$sm80_build" && pwd)
      {
        echo "--- cuobjdump --list-elf (expected: none)"
        cuobjdump --list-elf "$sm80_build/libflashkda.so"
        echo "--- cuobjdump --list-ptx"
        cuobjdump --list-ptx "$sm80_build/libflashkda.so"
        echo "--- the library the tests load"
        LD_LIBRARY_PATH="$sm80_dir" ldd "$sm80_tests" | grep flashkda
      } >"$out/sm80_ptx.txt" 2>&1
      if grep -q "^ELF file" "$out/sm80_ptx.txt" || ! grep -q "^PTX file.*sm_80" "$out/sm80_ptx.txt"; then
        failure sm80_ptx "$sm80_build/libflashkda.so is not a compute_80 PTX-only build (see sm80_ptx.txt)"
        continue
      fi
      if ! grep "libflashkda.so.0 =>" "$out/sm80_ptx.txt" | grep -q "$sm80_dir/"; then
        failure sm80_ptx "the tests of $sm80_build do not load its library (see sm80_ptx.txt)"
        continue
      fi
      step_in "$sm80_dir" sm80_ptx 300 "$out/sm80_ptx.log" "$sm80_tests" "[gpu]" --warn NoTests
      ;;
    build_info)
      # What the kernels were built with against the driver found: the
      # driver must be at or above the build's floor and a GPU plan must work
      # (compare scripts/release-build.sh's build with the default one).
      step build_info 60 "$out/build_info.log" env PYTHONPATH="$PWD/bindings/python" \
        FLASHKDA_LIBRARY="$PWD/$build/libflashkda.so.0" PYTHONDONTWRITEBYTECODE=1 "$python" -c '
import flashkda
build, device = flashkda.build_info(), flashkda.query_device()
print("build: ", build)
print("device:", device)
assert device.driver_version >= build.min_driver_version and device.has_kernels
flashkda.Plan(1, backend="gpu").close()
print("a GPU plan: ok")'
      cat "$out/build_info.log" >>"$summary"
      ;;
    serving)
      # The serving paths (decode, prefill by pool slot with checkpoints),
      # compute-sanitizer memcheck and racecheck on their small cases (also
      # part of the [sanitize] set of the memcheck, racecheck and synccheck
      # steps), and the timings of fkda-bench's serving cases (D1-D8, S1-S3,
      # R1, R2).
      require serving "$tests" || continue
      step serving 300 "$out/serving.log" "$tests" "[decode],[pool]" --durations yes --warn NoTests
      for tool in memcheck racecheck; do
        step "serving_$tool" 300 "$out/serving_sanitizer.log" compute-sanitizer --tool "$tool" \
          --error-exitcode 3 "$tests" "[decode][sanitize],[pool][sanitize]" --warn NoTests
      done
      grep -hE " out [0-9]| state [0-9]|mutation|differing|warps a block|unwritten|FAIL" "$out/serving.log" | tail -n 80
      require serving_bench "$build/bench/fkda-bench" || continue
      step serving_bench 300 "$out/serving_bench.log" "$build/bench/fkda-bench" serving --warmup 5 --iters 30 \
        --json "$out/serving_bench.json"
      tail -n 20 "$out/serving_bench.log" >>"$summary"
      ;;
    bench)
      require bench "$build/bench/fkda-bench" || continue
      step bench 200 "$out/bench.log" "$build/bench/fkda-bench" prefill --warmup 5 --iters 30 \
        --json "$out/bench.json"
      tail -n 26 "$out/bench.log" >>"$summary"
      ;;
    bench_f32)
      require bench_f32 "$build/bench/fkda-bench" || continue
      step bench_f32 200 "$out/bench_f32.log" "$build/bench/fkda-bench" prefill --state f32 --warmup 5 \
        --iters 30 --json "$out/bench_f32.json"
      tail -n 14 "$out/bench_f32.log" >>"$summary"
      ;;
    timing)
      # docs/BENCHMARKS.md's P1, P4 and P5 with both state dtypes, timed by fkda-bench.
      require timing "$build/bench/fkda-bench" || continue
      step timing 120 "$out/timing.log" "$build/bench/fkda-bench" P1 P4 P5 --warmup 5 --iters 30
      step timing_f32 120 "$out/timing.log" "$build/bench/fkda-bench" P1 --state f32 --warmup 5 --iters 30
      grep -E "^P[0-9]+ " "$out/timing.log" | tee -a "$summary"
      ;;
    accuracy)
      require accuracy "$build/bench/fkda-bench" || continue
      step accuracy 120 "$out/accuracy.log" "$build/bench/fkda-bench" accuracy
      tail -n 8 "$out/accuracy.log" >>"$summary"
      ;;
    packaged)
      # The release artefacts of scripts/dist.sh ($DIST, default dist): the
      # [gpu] tests against the library of the runtime .deb unpacked into a
      # scratch root, then flashkda.fwd on torch CUDA tensors with the package
      # and library of the wheel alone, held against the CPU backend.
      dist=${DIST:-dist}
      deb=$(ls "$dist"/libflashkda[0-9]*_*.deb 2>/dev/null | head -n 1)
      wheel=$(ls "$dist"/flashkda-*.whl 2>/dev/null | head -n 1)
      if [ -z "$deb" ] || [ -z "$wheel" ]; then
        failure packaged "no runtime .deb or wheel in $dist (bash scripts/dist.sh)"
        continue
      fi
      require packaged "$tests" || continue
      root="$out/packaged-root"
      rm -rf "$root"
      dpkg-deb -x "$deb" "$root"
      deb_lib=$(dirname "$(find "$root" -name libflashkda.so.0 | head -n 1)")
      step_in "$deb_lib" packaged_deb 600 "$out/packaged_deb.log" "$tests" "[gpu]"
      site="$out/packaged-wheel"
      rm -rf "$site"
      "$python" -m pip install --quiet --no-deps --no-index --target "$site" "$wheel"
      step packaged_wheel 300 "$out/packaged_wheel.log" env -u FLASHKDA_LIBRARY \
        PYTHONPATH="$site" PYTHONDONTWRITEBYTECODE=1 "$python" -c '
import os, torch, flashkda
site = os.environ["PYTHONPATH"]
print("library:", flashkda.library_path(), "build:", flashkda.build_info())
assert flashkda.library_path().startswith(site), (flashkda.library_path(), site)
assert flashkda.build_info().min_driver_version == 12000, flashkda.build_info()
torch.manual_seed(0)
B, T, H, K = 1, 96, 2, 128
q, k, v, g = (torch.randn(B, T, H, K).to(torch.bfloat16) for _ in range(4))
beta = torch.randn(B, T, H).to(torch.bfloat16)
A_log, dt_bias = torch.rand(H), torch.rand(H, K)
cpu_out = torch.empty(B, T, H, K, dtype=torch.bfloat16)
flashkda.fwd(q, k, v, g, beta, K ** -0.5, cpu_out, A_log, dt_bias, -5.0)
cuda = [t.cuda() for t in (q, k, v, g, beta)]
gpu_out = torch.empty(B, T, H, K, dtype=torch.bfloat16, device="cuda")
flashkda.fwd(*cuda, K ** -0.5, gpu_out, A_log.cuda(), dt_bias.cuda(), -5.0)
torch.cuda.synchronize()
error = ((gpu_out.cpu().float() - cpu_out.float()).norm() / cpu_out.float().norm()).item()
print("relative L2 difference, GPU against CPU:", error)
assert error < 1e-2, error'
      ;;
    demo)
      require demo "$build/examples/fkda-demo" || continue
      step demo 60 "$out/demo.log" "$build/examples/fkda-demo"
      cat "$out/demo.log" >>"$summary"
      ;;
    python)
      # The Python binding with torch CUDA tensors (and every CPU test too).
      step python 300 "$out/python.log" env PYTHONPATH="$PWD/bindings/python" \
        FLASHKDA_LIBRARY="$PWD/$build/libflashkda.so.0" PYTHONDONTWRITEBYTECODE=1 \
        "$python" -m pytest -q -rs -p no:cacheprovider bindings/python/tests \
        --ignore=bindings/python/tests/test_wheel.py
      tail -n 15 "$out/python.log" >>"$summary"
      ;;
    sweep)
      # Every V split forced on cases of few and many (sequence, head) pairs.
      require sweep "$build/bench/fkda-bench" || continue
      for v in 1 2 4 8; do
        step "sweep=$v" 100 "$out/sweep.log" env FKDA_VSPLIT=$v "$build/bench/fkda-bench" P1 P3 P4 P8 P9 \
          --warmup 3 --iters 10
      done
      grep -E "^=== |^P[0-9]+ " "$out/sweep.log" | tee -a "$summary"
      ;;
    profile)
      # Kernel durations of P1, P4 and P5, and how the preparation kernel of P1
      # uses the SMs (Nsight Compute; clocks left as they are).
      require profile "$build/bench/fkda-bench" || continue
      for c in P1 P4 P5; do
        step "profile $c" 120 "$out/profile.txt" ncu --clock-control none --metrics gpu__time_duration.sum \
          -k regex:fkda_prefill --launch-skip 4 --launch-count 4 "$build/bench/fkda-bench" "$c" --warmup 2 --iters 2
      done
      step "profile P1" 150 "$out/profile.txt" ncu --clock-control none -k regex:prepare_chunks --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats "$build/bench/fkda-bench" P1 --warmup 2 --iters 1
      grep -E "^===|fkda_prefill|gpu__time_duration" "$out/profile.txt" | head -60 | tee -a "$summary"
      ;;
    *)
      failure "$s" "unknown step (known: info tests vsplit window memcheck racecheck synccheck sm80_ptx serving bench bench_f32 timing accuracy demo python sweep profile)"
      ;;
  esac
done

# The per-case accuracy lines and mutation margins of the tests, then the summary.
grep -hE "vs fp64|mutation" "$out/tests.log" 2>/dev/null | tail -n 120
echo "=== summary"
cat "$summary"
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== FAILED: ${failed[*]}"
  exit 1
fi
echo "=== every step passed"
