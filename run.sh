#!/usr/bin/env bash
# Developer entry point.
#   bash run.sh setup         create .venv with the pinned requirements
#   bash run.sh build         configure + build into build/ (incremental)
#   bash run.sh test [args]   build, then C++ tests (ctest) and pytest [args]
#   bash run.sh demo [args]   build, then python -m lowbit.demo [args]
#   bash run.sh bench SUITE   build, then python -m lowbit.bench SUITE ...
# Set PYTHON=/path/to/python to use an existing environment that already has
# torch (and pytest) instead of .venv; nothing is installed then. Builds use
# the system g++ (LOWBIT_CXX=/path/to/c++ for another).
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
BUILD_DIR=${BUILD_DIR:-build}

setup() {
  if [[ -n "${PYTHON:-}" ]]; then return; fi
  local stamp=.venv/.requirements-dev.txt
  if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
  fi
  if ! cmp -s requirements-dev.txt "$stamp"; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -r requirements-dev.txt
    cp requirements-dev.txt "$stamp"
  fi
  PYTHON=$ROOT/.venv/bin/python
  export PATH=$ROOT/.venv/bin:$PATH
}

build() {
  setup
  # The system g++, whose libstdc++ is the one the process loads, for the
  # .cpp files and as nvcc's host compiler alike: a compiler that puts its
  # own copies of libstdc++'s stream code into the library makes one that
  # crashes in its string formatting (docs/ARCHITECTURE.md, "Toolchain").
  # An inherited CUDAHOSTCXX is not followed (one image sets it to such a
  # compiler); LOWBIT_CXX picks another for both. Both are read at the
  # first configure only.
  export CXX=${LOWBIT_CXX:-$(command -v g++ || echo c++)}
  export CUDAHOSTCXX=$CXX
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  if [[ ! -f $BUILD_DIR/CMakeCache.txt ]] || ! grep -qE "^Python3_EXECUTABLE:[A-Z]+=$PYTHON\$" "$BUILD_DIR/CMakeCache.txt"; then
    rm -rf "$BUILD_DIR"
    # shellcheck disable=SC2086
    cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DPython3_EXECUTABLE="$PYTHON" ${CMAKE_ARGS:-}
  fi
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

run_python() {
  local lib=$BUILD_DIR/liblowbit_ops.so
  [[ $lib == /* ]] || lib=$ROOT/$lib
  LOWBIT_OPS_LIBRARY=$lib PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  build) build ;;
  test)
    build
    if [[ -x $BUILD_DIR/lowbit_core_tests ]]; then
      ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"
    else
      echo "run.sh: GoogleTest not found at configure time; C++ core tests not built" >&2
    fi
    run_python -m pytest "$@"
    ;;
  demo) build; run_python -m lowbit.demo "$@" ;;
  bench) build; run_python -m lowbit.bench "$@" ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
