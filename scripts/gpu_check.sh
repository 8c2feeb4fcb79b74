#!/usr/bin/env bash
# The GPU script: on a fresh GPU machine (no network; its python3 has torch,
# pytest and hypothesis) build everything, run the whole test suite on the
# GPU, run the benchmarks, and print a short summary last. Logs and JSON go
# to $OUT (or ./gpu-results).
#
#   bash scripts/gpu_check.sh                       everything
#   TESTS="tests/python/test_x.py" SUITES="quant" bash scripts/gpu_check.sh
#   SUITES="" ...          skip benchmarks;  BENCH_ARGS=--quick  fewer shapes
# The whole GPU test suite runs longer than one 10-minute device call (about
# 60% of it in 8 minutes on an H200, session 36): give TESTS a part of it per
# call. tests.log ends with the slowest tests, to plan the parts.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHON=${PYTHON:-python3}
export JOBS=${JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1
SUITES=${SUITES-quant linear router moe}
TESTS=${TESTS:-}
BENCH_ARGS=${BENCH_ARGS:-}
# Build with the system compiler, whose libstdc++ is the one loaded at run
# time (see docs/ARCHITECTURE.md, "Toolchain"); LOWBIT_CXX overrides it.
export CXX=${LOWBIT_CXX:-$(command -v g++)}
export CUDAHOSTCXX=$CXX
if [[ -d .deps/gtest ]]; then export CMAKE_ARGS="${CMAKE_ARGS:-} -DGTEST_ROOT=$PWD/.deps/gtest"; fi

summary=()
failed=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

start=$(date +%s)
if ! bash run.sh build >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
summary+=("build: ok in $(( $(date +%s) - start )) s")

start=$(date +%s)
# shellcheck disable=SC2086
bash run.sh test -q -p no:cacheprovider --durations=15 $TESTS >"$OUT/tests.log" 2>&1
rc=$?
summary+=("tests: rc=$rc in $(( $(date +%s) - start )) s: $(grep -E '^[0-9]+ (passed|failed)|[0-9]+ passed|tests passed' "$OUT/tests.log" | tail -2 | tr '\n' ' ')")
if [[ $rc -ne 0 ]]; then
  failed=1
  grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -30
fi

: >"$OUT/bench.log"
for suite in $SUITES; do
  if [[ ! -f python/lowbit/bench/$suite.py ]]; then continue; fi
  start=$(date +%s)
  # shellcheck disable=SC2086
  if bash run.sh bench "$suite" --json "$OUT/bench_$suite.json" $BENCH_ARGS >>"$OUT/bench.log" 2>&1; then
    summary+=("bench $suite: ok in $(( $(date +%s) - start )) s")
  else
    failed=1
    summary+=("bench $suite: FAILED (see bench.log)")
  fi
done

echo "=== benchmarks"
cat "$OUT/bench.log"
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $failed
