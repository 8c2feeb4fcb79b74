#!/usr/bin/env bash
# Which compilers built the op library, which libstdc++ it links and which
# one a Python process loads with it, what of libstdc++ the library defines
# itself, and whether an error message (integer formatting in TORCH_CHECK)
# comes back as an exception or kills the process. A library whose error
# paths crash has carried its own copies of libstdc++'s stream code
# (docs/ARCHITECTURE.md, "Toolchain"); this says so before a test does.
#
#   bash scripts/toolchain_report.sh [BUILD_DIR]      (default: build)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BUILD_DIR=${1:-build}
PYTHON=${PYTHON:-python3}
LIB=$BUILD_DIR/liblowbit_ops.so
[[ -f $LIB ]] || { echo "no $LIB (build first)"; exit 1; }

cache=$BUILD_DIR/CMakeCache.txt
for key in CMAKE_CXX_COMPILER CMAKE_CUDA_HOST_COMPILER CMAKE_CUDA_COMPILER; do
  path=$(grep -E "^$key:" "$cache" 2>/dev/null | cut -d= -f2-)
  [[ -n $path ]] || continue
  echo "$key: $path ($("$path" --version 2>/dev/null | head -1))"
done
echo "libstdc++ of that g++: $(g++ -print-file-name=libstdc++.so.6 2>/dev/null)"
echo "library links: $(ldd "$LIB" 2>/dev/null | grep -E 'libstdc\+\+|libgcc_s' | awk '{print $1, "->", $3}' | tr '\n' ' ')"
# Stream code the library defines itself instead of importing (T/W: defined).
own=$(nm -C --defined-only "$LIB" 2>/dev/null | grep -E '^[0-9a-f]+ [TWtw] (.* )?std::(basic_ostream<[^ ]*>|ostream|num_put<[^ ]*>)::' |
  sed 's/^[0-9a-f]* //' | sort -u | head -5)
echo "stream code defined in the library: ${own:-none}"
echo "libstdc++ loaded by python with torch and the library: $(
  LOWBIT_OPS_LIBRARY=$PWD/$LIB "$PYTHON" -c '
import os, torch
torch.ops.load_library(os.environ["LOWBIT_OPS_LIBRARY"])
print(" ".join(sorted({l.split()[-1] for l in open("/proc/self/maps") if "libstdc++" in l})))' 2>&1 | tail -1)"
# An error message with integers in it: an exception, not a signal.
LOWBIT_OPS_LIBRARY=$PWD/$LIB PYTHONPATH=python "$PYTHON" -c '
import lowbit
try:
    lowbit.explain_plan(1, 17, 16, "cpu")
except ValueError as e:
    print("error message: ok:", str(e).splitlines()[0][:100])
else:
    print("error message: no error raised")' 2>&1 | tail -1
rc=${PIPESTATUS[0]}
[[ $rc -ge 128 ]] && echo "error message: the process died with signal $((rc - 128))"
exit 0
