#!/usr/bin/env bash
# The GPU check, run on a machine with an NVIDIA GPU against a build made
# elsewhere (or here): the [gpu] tests, the V-split and window-size variants,
# compute-sanitizer (memcheck, racecheck) on the [sanitize] subset, timings of
# docs/BENCHMARKS.md cases, and what the embedded fatbin holds.
#
#   scripts/gpu_check.sh [BUILD_DIR] [STEP...]
#
# BUILD_DIR defaults to build-gpu. STEPs: info tests vsplit window memcheck
# memcheck_window racecheck bench sweep (the default), timing profile. Logs go to $OUT (default ./gpu-check-logs); the
# last lines printed are a summary.
set -uo pipefail

build=${1:-build-gpu}
shift || true
steps=${*:-info tests vsplit window memcheck memcheck_window racecheck bench sweep}
out=${OUT:-$PWD/gpu-check-logs}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tests="$build/tests/fkda_gpu_tests"
summary="$out/summary.txt"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

# Runs a step under a time limit, records its exit status and Catch2's totals.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local totals
  totals=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
  note "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - start)) "$totals")"
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
      note "info       $(grep -c ELF "$out/info.txt") ELF lines; see info.txt"
      ;;
    tests)
      step tests 300 "$out/tests.log" "$tests" "[gpu]" --durations yes
      ;;
    vsplit)
      for v in 1 2 4 8; do
        echo "=== FKDA_VSPLIT=$v" >>"$out/vsplit.log"
        step "vsplit=$v" 90 "$out/vsplit.log" env FKDA_VSPLIT=$v "$tests" "[vsplit]"
      done
      ;;
    window)
      # Small forced windows put window boundaries inside, at the ends of and
      # between sequences, so that states cross many of them.
      for w in 1 3 7; do
        echo "=== FKDA_WINDOW_SLOTS=$w" >>"$out/window.log"
        step "window=$w" 240 "$out/window.log" env FKDA_WINDOW_SLOTS=$w "$tests" "[window],[sanitize]"
      done
      ;;
    memcheck_window)
      step memcheck_w 240 "$out/sanitizer.log" env FKDA_WINDOW_SLOTS=3 compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$tests" "[sanitize]"
      ;;
    memcheck)
      step memcheck 240 "$out/sanitizer.log" compute-sanitizer --tool memcheck --error-exitcode 3 "$tests" "[sanitize]"
      ;;
    racecheck)
      step racecheck 240 "$out/sanitizer.log" compute-sanitizer --tool racecheck --racecheck-report all \
        --error-exitcode 3 "$tests" "[sanitize]"
      ;;
    serving)
      # The serving paths (decode, prefill by pool slot with checkpoints),
      # compute-sanitizer memcheck and racecheck on their small cases, and
      # the timings of fkda-bench's serving cases (D1-D8, S1-S3, R1, R2).
      step serving 300 "$out/serving.log" "$tests" "[decode],[pool]" --durations yes
      for tool in memcheck racecheck; do
        step "serving_$tool" 300 "$out/serving_sanitizer.log" compute-sanitizer --tool "$tool" \
          --error-exitcode 3 "$tests" "[decode][sanitize],[pool][sanitize]"
      done
      grep -hE " out [0-9]| state [0-9]|mutation|differing|warps a block|unwritten|FAIL" "$out/serving.log" | tail -n 80
      if [ -x "$build/bench/fkda-bench" ]; then
        step serving_bench 300 "$out/serving_bench.log" "$build/bench/fkda-bench" serving --warmup 5 --iters 30 \
          --json "$out/serving_bench.json"
        tail -n 20 "$out/serving_bench.log" >>"$summary"
      fi
      ;;
    timing)
      step timing 120 "$out/timing.log" "$tests" "[timing]"
      grep "^timing" "$out/timing.log" | tee -a "$summary"
      ;;
    bench)
      if [ -x "$build/bench/fkda-bench" ]; then
        step bench 200 "$out/bench.log" "$build/bench/fkda-bench" prefill --warmup 5 --iters 30 \
          --json "$out/bench.json"
        tail -n 26 "$out/bench.log" >>"$summary"
      fi
      ;;
    bench_f32)
      if [ -x "$build/bench/fkda-bench" ]; then
        step bench_f32 200 "$out/bench_f32.log" "$build/bench/fkda-bench" prefill --state f32 --warmup 5 \
          --iters 30 --json "$out/bench_f32.json"
        tail -n 14 "$out/bench_f32.log" >>"$summary"
      fi
      ;;
    accuracy)
      if [ -x "$build/bench/fkda-bench" ]; then
        step accuracy 120 "$out/accuracy.log" "$build/bench/fkda-bench" accuracy
        tail -n 8 "$out/accuracy.log" >>"$summary"
      fi
      ;;
    demo)
      step demo 60 "$out/demo.log" "$build/examples/fkda-demo"
      cat "$out/demo.log" >>"$summary"
      ;;
    python)
      # The Python binding with torch CUDA tensors (and every CPU test too).
      step python 300 "$out/python.log" env PYTHONPATH="$PWD/bindings/python" \
        FLASHKDA_LIBRARY="$PWD/$build/libflashkda.so.0" PYTHONDONTWRITEBYTECODE=1 \
        python3 -m pytest -q -rs -p no:cacheprovider bindings/python/tests \
        --ignore=bindings/python/tests/test_wheel.py
      tail -n 15 "$out/python.log" >>"$summary"
      ;;
    sweep)
      # Every V split forced on cases of few and many (sequence, head) pairs.
      if [ -x "$build/bench/fkda-bench" ]; then
        for v in 1 2 4 8; do
          echo "=== FKDA_VSPLIT=$v" >>"$out/sweep.log"
          FKDA_VSPLIT=$v timeout 100 "$build/bench/fkda-bench" P1 P3 P4 P8 P9 --warmup 3 --iters 10 >>"$out/sweep.log" 2>&1
        done
        grep -E "^=== |^P[0-9]+ " "$out/sweep.log" | tee -a "$summary"
      fi
      ;;
    profile)
      # Kernel durations of P1, P4 and P5, and how the preparation kernel of P1
      # uses the SMs (Nsight Compute; clocks left as they are).
      if [ -x "$build/bench/fkda-bench" ]; then
        for c in P1 P4 P5; do
          echo "=== $c durations" >>"$out/profile.txt"
          timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:fkda_prefill \
            --launch-skip 4 --launch-count 4 "$build/bench/fkda-bench" "$c" --warmup 2 --iters 2 \
            >>"$out/profile.txt" 2>&1
        done
        echo "=== P1 prepare sections" >>"$out/profile.txt"
        timeout 150 ncu --clock-control none -k regex:prepare_chunks --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section SchedulerStats "$build/bench/fkda-bench" P1 --warmup 2 --iters 1 \
          >>"$out/profile.txt" 2>&1
        grep -E "^===|fkda_prefill|gpu__time_duration" "$out/profile.txt" | head -60 | tee -a "$summary"
      fi
      ;;
    *)
      note "unknown step $s"
      ;;
  esac
done

# The per-case accuracy lines of the tests, then the summary.
grep -hE "vs fp64" "$out/tests.log" 2>/dev/null | tail -n 60
echo "=== summary"
cat "$summary"
