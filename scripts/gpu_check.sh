#!/usr/bin/env bash
# The GPU script: on a fresh GPU machine (no network; its python3 has torch,
# pytest, pytest-xdist and hypothesis) build everything, run the whole test
# suite on the GPU under pytest-xdist, optionally the benchmarks, write a
# dated run record ($OUT/record.md) and print a short summary table last.
# Logs and JSON go to $OUT (or ./gpu-results).
#
#   bash scripts/gpu_check.sh                       build + C++ tests + the whole pytest suite
#   WORKERS=6 bash scripts/gpu_check.sh             xdist workers (default 8; 0 or 1: one process)
#   TESTS="tests/python/test_x.py" bash scripts/gpu_check.sh     a part of the suite
#   TESTS="-m concurrency" ...                      only the concurrency test
#   SUITES="quant linear router moe" BENCH_ARGS=--quick ...      benchmarks too (default: none)
#   MODE=sanitize bash scripts/gpu_check.sh         compute-sanitizer (memcheck, racecheck,
#                                                   synccheck, initcheck) over scripts/sanitize_ops.py
#   TOOLS="memcheck racecheck" SANITIZE_TIMEOUT=75  sanitize: which tools, seconds per process (default 75;
#                                                   racecheck and initcheck: one process per op family)
#   SANITIZE_FAMILIES="fp8 quant"                   sanitize: only these op families (one process each)
#   COMMIT=abc1234 ...                              the commit the record names (default: git rev-parse)
#   SPREAD_GPUS=4 WORKERS=24 ...                   a machine of several GPUs: worker k runs on the (k mod 4)-th GPU
#                                                   (of CUDA_VISIBLE_DEVICES where set);
#                                                   test_fp8_parallel.py's multi-GPU tests then run after, on all of them
#   LOWBIT_TEST_WORLD=4 ...                         processes (GPUs) of test_fp8_parallel.py's multi-GPU tests (default 2)
# With 8 workers the build and the whole suite take about 6 minutes on an
# H100 machine (16 cores); tests.log ends with the slowest tests. The concurrency
# test (tests/python/test_concurrency.py) runs in the suite; its table goes
# to $OUT/concurrency.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHON=${PYTHON:-python3}
export JOBS=${JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1
MODE=${MODE:-tests}
WORKERS=${WORKERS:-8}
SPREAD_GPUS=${SPREAD_GPUS:-0}
SUITES=${SUITES-}
TESTS=${TESTS:-}
BENCH_ARGS=${BENCH_ARGS:-}
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-75}
SANITIZE_FAMILIES=${SANITIZE_FAMILIES:-}
BUILD_DIR=${BUILD_DIR:-build}
# run.sh build picks the compiler (the system g++; LOWBIT_CXX overrides it).
if [[ -d .deps/gtest ]]; then export CMAKE_ARGS="${CMAKE_ARGS:-} -DGTEST_ROOT=$PWD/.deps/gtest"; fi

summary=()   # "| phase | result | seconds |" rows
failed=0
run_start=$(date +%s)
row() { summary+=("| $1 | $2 | $3 |"); }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

# ---- the run record (written at the end, and on a build failure) ----------
write_record() {
  local gpu driver torchv commit dirty
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  torchv=$("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)
  # COMMIT: where the tree was copied without its git history (to a GPU
  # machine), the caller names the commit; the tree state is then unknown.
  if [[ -n ${COMMIT:-} ]]; then commit=$COMMIT; dirty="as given by the caller"
  else
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    if [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then dirty="dirty (uncommitted changes)"; else dirty="clean"; fi
  fi
  {
    echo "# GPU run $(date -u +%Y-%m-%d) ($commit, $MODE)"
    echo
    echo "| | |"
    echo "| --- | --- |"
    echo "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
    echo "| commit | $commit, tree $dirty |"
    echo "| GPU | ${gpu:-none} (driver ${driver:-?}) |"
    echo "| torch | ${torchv:-?} |"
    echo "| command | \`MODE=$MODE WORKERS=$WORKERS TESTS=\"$TESTS\" SUITES=\"$SUITES\"${SANITIZE_FAMILIES:+ SANITIZE_FAMILIES=\"$SANITIZE_FAMILIES\"} bash scripts/gpu_check.sh\` |"
    [[ -n ${test_cmd:-} ]] && echo "| test command | \`$test_cmd\` |"
    [[ -n ${LOWBIT_TEST_WORLD:-} ]] && echo "| processes of the multi-GPU tests | LOWBIT_TEST_WORLD=$LOWBIT_TEST_WORLD |"
    [[ -n ${test_counts:-} ]] && echo "| tests | $test_counts |"
    [[ -n ${concurrency:-} ]] && echo "| concurrency test | $concurrency |"
    echo "| wall time | $(( $(date +%s) - run_start )) s |"
    echo
    echo "| phase | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${summary[@]}"
    if [[ -n ${toolchain:-} ]]; then
      echo
      echo "## Toolchain (scripts/toolchain_report.sh)"
      echo
      echo '```'
      echo "$toolchain"
      echo '```'
    fi
    if [[ -s $OUT/concurrency.md ]]; then
      echo
      echo "## Concurrency test"
      echo
      cat "$OUT/concurrency.md"
    fi
    if [[ -n ${failed_tests:-} ]]; then
      echo
      echo "## Failed tests"
      echo
      echo '```'
      echo "$failed_tests"
      echo '```'
    fi
  } >"$OUT/record.md"
}

finish() {
  write_record
  echo "=== record: $OUT/record.md"
  echo "=== summary"
  echo "| phase | result | seconds |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${summary[@]}"
  exit "$failed"
}

start=$(date +%s)
if ! bash run.sh build >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "BUILD FAILED"
  failed=1
  row build FAILED $(( $(date +%s) - start ))
  finish
fi
row build ok $(( $(date +%s) - start ))
toolchain=$(bash scripts/toolchain_report.sh "$BUILD_DIR" 2>&1)
error_path=$(grep -m1 '^error message' <<<"$toolchain" | cut -c16-80)
[[ $error_path == ok:* ]] || failed=1   # an error message that kills the process fails the run
row "error path (toolchain)" "$error_path" 0
LIB=$BUILD_DIR/liblowbit_ops.so
[[ $LIB == /* ]] || LIB=$ROOT/$LIB

# ---- sanitize ---------------------------------------------------------------
if [[ $MODE == sanitize ]]; then
  if ! command -v compute-sanitizer >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
      [[ -x $d/compute-sanitizer ]] && PATH=$d:$PATH && break
    done
  fi
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not found"
    failed=1
    row sanitize "compute-sanitizer not found" 0
    finish
  fi
  compute-sanitizer --version | tail -1
  for tool in $TOOLS; do
    start=$(date +%s)
    extra_env=()
    # memcheck / initcheck: every tensor its own cudaMalloc, so an access
    # past a tensor's end (or a read of bytes never written) is not hidden
    # inside a block of PyTorch's caching allocator.
    if [[ $tool == memcheck || $tool == initcheck ]]; then extra_env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); fi
    # Only lowbit's kernels are checked (every one is in namespace lowbit):
    # PyTorch's and cuBLAS's kernels run unchecked (their reports are not
    # ours, and checking them costs time). initcheck is the exception: it
    # knows memory as written only by the kernels it follows, so a filter
    # would report every input that a PyTorch kernel filled. API errors are
    # not reported (PyTorch probes the driver with calls that may fail).
    filter=(--kernel-name kns=lowbit)
    [[ $tool == initcheck ]] && filter=()
    # racecheck (2025.3) failed internally ("failed to handle a hardware
    # exception") inside cuBLAS's GEMMs, and initcheck does not see those
    # kernels' writes: both leave out the cases that run one (their lowbit
    # kernels, the unpack pass and the FP8 row rounding, run under memcheck
    # and synccheck; the unpack pass also alone). The checks' float32
    # references run on the CPU (sanitize_ops.py), so no other cuBLAS call
    # runs. Both take one process per op family, so that a failure of the
    # tool stops one family, not the rest. racecheck fails the same way in
    # torch's grouped FP8 GEMM (CUTLASS), so it also leaves out the MoE's FP8
    # path; initcheck runs it (the MoE zeroes the row scales that GEMM reads
    # past a group's last row).
    cases=()
    families=(all)
    if [[ $tool == racecheck || $tool == initcheck ]]; then
      cases=(--skip cuBLAS --skip bmm --skip "FP8 mode")
      [[ $tool == racecheck ]] && cases+=(--skip "grouped FP8 GEMMs")
      families=(quant linear grouped routing moe fp8)
    fi
    if [[ -n $SANITIZE_FAMILIES ]]; then read -ra families <<<"$SANITIZE_FAMILIES"; fi
    : >"$OUT/sanitize_$tool.log"
    rc=0
    for family in "${families[@]}"; do
      fam=()
      [[ $family == all ]] || fam=(--families "$family")
      echo "=== $tool ${fam[*]}" >>"$OUT/sanitize_$tool.log"
      env "${extra_env[@]}" LOWBIT_OPS_LIBRARY="$LIB" PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
        timeout -k 10 "$SANITIZE_TIMEOUT" compute-sanitizer --tool "$tool" "${filter[@]}" \
        --target-processes all --report-api-errors no --print-limit 20 --error-exitcode 3 \
        "$PYTHON" scripts/sanitize_ops.py "${fam[@]}" "${cases[@]}" >>"$OUT/sanitize_$tool.log" 2>&1
      r=$?
      [[ $r -eq 0 ]] || rc=$r
    done
    # Reports counted from the summaries, or from the reports themselves
    # where a process was cut off before its summary.
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$OUT/sanitize_$tool.log" | awk '{s += $3} END {print s + 0}')
    reports=$(grep -cE '^========= +(Invalid|Race|Uninitialized|Barrier|Misaligned|Out-of-range)' "$OUT/sanitize_$tool.log")
    [[ $errors -ge $reports ]] || errors=$reports
    fails=$(grep -c '^FAIL ' "$OUT/sanitize_$tool.log")
    if grep -q 'Internal Sanitizer Error' "$OUT/sanitize_$tool.log"; then
      result="the tool failed internally ($errors reports, $fails cases failed after it)"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
      result="timeout after ${SANITIZE_TIMEOUT} s ($errors errors so far)"
    elif [[ $errors -gt 0 ]]; then
      result="$errors errors"
    elif [[ $rc -ne 0 ]]; then
      result="clean, but the script failed (rc=$rc, $fails mismatched cases)"
    else
      result="clean"
    fi
    [[ $result == clean ]] || failed=1
    row "sanitize $tool" "$result" $(( $(date +%s) - start ))
    if [[ $result != clean ]]; then
      echo "=== sanitize $tool: $result"
      grep -E '^(FAIL|=========  *(Invalid|Race|Uninitialized|Barrier|Error|Warning))' "$OUT/sanitize_$tool.log" | head -15
    fi
  done
  finish
fi

# ---- tests ------------------------------------------------------------------
start=$(date +%s)
xdist=()
verbosity=-q
if [[ $WORKERS -le 1 ]]; then
  # One process: -v writes each test's name as it starts, so a test that
  # hangs (or a run stopped by a time limit) is named in tests.log.
  verbosity=-v
fi
if [[ $WORKERS -gt 1 ]]; then
  # loadgroup: the tests of one xdist_group (conftest.py: AOTInductor
  # packages) on one worker; the rest spread test by test.
  xdist=(-n "$WORKERS" --dist loadgroup)
  # Share the cores: each worker's intra-op threads (and the concurrency
  # test's processes) use nproc / WORKERS.
  threads=$(( $(nproc) / WORKERS ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
export LOWBIT_CONCURRENCY_REPORT=$OUT/concurrency.md
rm -f "$OUT/concurrency.md"
# Workers spread over the GPUs each see one, so the multi-GPU tests skip in
# this run; they run next, on all GPUs.
[[ $SPREAD_GPUS -gt 1 && $WORKERS -gt 1 ]] && export LOWBIT_TEST_SPREAD_GPUS=$SPREAD_GPUS
test_cmd="bash run.sh test $verbosity -p no:cacheprovider --durations=15 ${xdist[*]} $TESTS"
# shellcheck disable=SC2086
bash run.sh test $verbosity -p no:cacheprovider --durations=15 "${xdist[@]}" $TESTS >"$OUT/tests.log" 2>&1
rc=$?
# pytest's last line: "N passed, M skipped, K failed ... in S s"
last=$(grep -E ' in [0-9.]+s' "$OUT/tests.log" | grep -E '[0-9]+ (passed|failed|error|skipped)' | tail -1)
count() { local n; n=$(echo "$last" | grep -oE "[0-9]+ $1" | head -1 | awk '{print $1}'); echo "${n:-0}"; }
test_counts="$(count passed) passed, $(count failed) failed, $(count skipped) skipped, $(count 'errors?') errors"
ctest_line=$(grep -E 'tests passed, [0-9]+ tests failed' "$OUT/tests.log" | tail -1)
[[ -n $ctest_line ]] && row "C++ tests (ctest)" "$ctest_line" "-"
row "pytest (${WORKERS} workers)" "rc=$rc: $test_counts" $(( $(date +%s) - start ))
if [[ $rc -ne 0 ]]; then
  failed=1
  failed_tests=$(grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -30)
  echo "$failed_tests"
fi
if [[ -n ${LOWBIT_TEST_SPREAD_GPUS:-} ]] && [[ -z $TESTS || $TESTS == *test_fp8_parallel* ]]; then
  start=$(date +%s)
  unset LOWBIT_TEST_SPREAD_GPUS
  LOWBIT_TEST_WORLD=${LOWBIT_TEST_WORLD:-$SPREAD_GPUS} LOWBIT_OPS_LIBRARY="$LIB" \
    PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/python/test_fp8_parallel.py -k cuda_nccl >"$OUT/tests_multi_gpu.log" 2>&1
  rc=$?
  last=$(grep -E ' in [0-9.]+s' "$OUT/tests_multi_gpu.log" | tail -1)
  row "multi-GPU tests (${LOWBIT_TEST_WORLD:-$SPREAD_GPUS} processes)" "rc=$rc: $last" $(( $(date +%s) - start ))
  if [[ $rc -ne 0 ]]; then
    failed=1
    failed_tests+=$'\n'$(grep -E '^(FAILED|ERROR)' "$OUT/tests_multi_gpu.log" | head -10)
  fi
fi
if [[ -s $OUT/concurrency.md ]]; then
  if grep -q '^no failures' "$OUT/concurrency.md"; then concurrency="passed ($(head -1 "$OUT/concurrency.md" | cut -c1-120)...)"
  else concurrency="FAILED (see the table below)"; fi
elif grep -qE 'SKIPPED.*test_concurrency.py|test_concurrency.py.*SKIPPED' "$OUT/tests.log"; then concurrency="skipped"
else concurrency="not run"; fi
row "concurrency test" "${concurrency%% (*}" "-"

# ---- benchmarks (SUITES) ----------------------------------------------------
: >"$OUT/bench.log"
for suite in $SUITES; do
  if [[ ! -f python/lowbit/bench/$suite.py ]]; then continue; fi
  start=$(date +%s)
  # shellcheck disable=SC2086
  if bash run.sh bench "$suite" --json "$OUT/bench_$suite.json" $BENCH_ARGS >>"$OUT/bench.log" 2>&1; then
    row "bench $suite" ok $(( $(date +%s) - start ))
  else
    failed=1
    row "bench $suite" "FAILED (see bench.log)" $(( $(date +%s) - start ))
  fi
done
if [[ -s $OUT/bench.log ]]; then
  echo "=== benchmarks"
  cat "$OUT/bench.log"
fi
finish
