#!/usr/bin/env bash
# The GPU checks of this tree, in one go on a machine with a GPU: build (or take the build carried in
# .devbuild/, see scripts/devbuild.sh), the C++ and Python GPU suites, the kernel tests under
# compute-sanitizer (memcheck, racecheck), the demo and the libtorch example, then the benchmarks
# named in SNACK_BENCH. Logs and result files go to $OUT (default /tmp/snack-gpu). Stages are
# separated so that one failure does not hide the others; the exit code is non-zero when any failed.
#   SNACK_STAGES="build ctest pytest sanitize demo example bench"   (default: all)
#   SNACK_BENCH="python bench/spmm.py --quick"                       (commands, ';'-separated)
#   SNACK_PYTEST_ARGS="tests/python"                                 (what the pytest stage runs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/snack-gpu}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
STAGES=${SNACK_STAGES:-"build ctest pytest bench sanitize demo example"}
PY=${PYTHON:-python3}
failed=()

stage() {  # stage NAME COMMAND...
  local name=$1; shift
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "=== [$name] $(date -u +%H:%M:%S) $*" | tee -a "$LOG"
  local t0=$SECONDS
  if ! "$@" >>"$LOG" 2>&1; then failed+=("$name"); echo "=== [$name] FAILED" | tee -a "$LOG"; fi
  echo "=== [$name] $((SECONDS - t0)) s" | tee -a "$LOG"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  git log -1 --format='commit %H %s' 2>/dev/null || echo "commit ${SNACK_COMMIT:-unknown}"
} >>"$LOG" 2>&1

[ -x /usr/local/cuda/bin/nvcc ] && export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
TORCH_LIB=$("$PY" -c "import torch, os; print(os.path.dirname(torch.__file__) + '/lib')")
NV_LIB=$("$PY" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH="${NV_LIB}:${TORCH_LIB}:${LD_LIBRARY_PATH:-}"

# The library errors must reach Python as exceptions (libstdc++ shared with libtorch:
# src/torch/CMakeLists.txt).
check_library() {
  local lib; lib=$("$PY" -c 'import snack; print(snack.LIBRARY_PATH)') || return 1
  echo "snack library: $lib"
  readelf -d "$lib" | grep NEEDED
  readelf -d "$lib" | grep -q "NEEDED.*libstdc++" || { echo "libsnack_torch.so does not need libstdc++.so"; return 1; }
  "$PY" - <<'PY'
import torch, snack
try:
    snack.ops.random_slots(70000, 2, 1, index_dtype=torch.uint16)
    raise SystemExit("no error raised")
except ValueError as e:
    print("C++ errors reach Python:", str(e)[:60])
PY
}

build() {
  if [ -f .devbuild/install/lib/libsnack_torch.so ]; then
    echo "using the build carried in .devbuild/"
  else
    "$PY" -m pip install --no-build-isolation --no-deps --config-settings=cmake.define.SNACK_REQUIRE_CUDA=ON \
      --config-settings=cmake.define.SNACK_PTXAS_VERBOSE=ON -v . > "$OUT/build_verbose.txt" 2>&1 ||
      { tail -50 "$OUT/build_verbose.txt"; return 1; }
    grep -A2 "Compiling entry function '_ZN5snack" "$OUT/build_verbose.txt" | grep -E "entry|Used|spill" | head -200
    rm -f "$OUT/build_verbose.txt"
  fi
  check_library
}
# The fuzzers need hypothesis: from the wheels carried in .devbuild/ where the machine has no network.
if ! "$PY" -c "import hypothesis" 2>/dev/null && [ -d .devbuild/wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .devbuild/wheels hypothesis >>"$LOG" 2>&1 || true
fi
if [ -f .devbuild/install/lib/libsnack_torch.so ]; then
  export SNACK_TORCH_LIBRARY=$PWD/.devbuild/install/lib/libsnack_torch.so PYTHONPATH=$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# The C++ core tests: the binary carried in .devbuild/, else built here (with GoogleTest installed).
ctest_binary() {
  if [ -x .devbuild/snack_core_tests ]; then
    echo .devbuild/snack_core_tests
  elif [ -e /usr/include/gtest/gtest.h ]; then
    cmake -S . -B build/ctest -G Ninja -DSNACK_BUILD_TESTS=ON -DSNACK_BUILD_TORCH=OFF >/dev/null &&
      cmake --build build/ctest >/dev/null && echo build/ctest/tests/cpp/snack_core_tests
  fi
}

run_ctest() {
  local bin; bin=$(ctest_binary)
  [ -n "$bin" ] || { echo "no C++ test binary"; return 1; }
  SNACK_TEST_DATA_DIR=$PWD/tests/cpp/data "$bin" --gtest_brief=1
}

# The kernels under compute-sanitizer: the C++ suite whole, and the Python kernel tests without the
# largest problems (the sanitizer runs them ~100x slower). Not the capture of a fused step: under
# the sanitizer, torch fails to capture any backward in which no parameter receives a gradient
# (scripts/repro_capture_memcheck.py shows it without snack).
sanitize() {
  local bin; bin=$(ctest_binary)
  local rc=0
  export SNACK_TEST_DATA_DIR=$PWD/tests/cpp/data
  compute-sanitizer --tool memcheck --error-exitcode 9 "$bin" --gtest_brief=1 || rc=1
  compute-sanitizer --tool racecheck --error-exitcode 9 "$bin" --gtest_brief=1 --gtest_filter='Cuda*' || rc=1
  # Every kernel variant on the odd sizes in fp32 and bf16, the long-row, alignment, infinity and
  # graph tests; the ops of each index width.
  local kernels="((forward_variant or transposed_variant or sddmm_variant) and (float32 or bfloat16) and not 40000)"
  kernels="$kernels or wide_rows_closes or long_rows_split or stored_entries or unaligned or programmatic"
  kernels="$kernels or (tensor_core_paths and bfloat16 and not 70x9000) or tensor_core_splits"
  kernels="$kernels or (tile_view_paths and bfloat16 and not 16384)"
  kernels="$kernels or dense_blocks_in_many_blocks or (sddmm_tensor_core_tiles and bfloat16) or sddmm_tile_view"
  compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider \
    -k "${SNACK_MEMCHECK_K:-$kernels}" tests/python/test_kernels_cuda.py || rc=1
  compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider \
    -k "cuda and float32" tests/python/test_ops.py || rc=1
  # The channels-first product (every pixel width) and the fused attention kernels.
  compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider \
    -k "(spmm_channels_first and cuda and (float32 or bfloat16)) or fused" tests/python/test_conv.py \
    tests/python/test_attention.py || rc=1
  compute-sanitizer --tool racecheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider \
    -k "${SNACK_RACECHECK_K:-wide_rows_closes or long_rows_split or sddmm_skewed or (130x257 and float32) or (tensor_core_paths and bfloat16 and (130x1001 or 100x2051)) or (tile_view_paths and bfloat16 and (130x1001 or 64x64x4096)) or (sddmm_tensor_core_tiles and bfloat16 and not 2048) or (sddmm_tile_view_tiles and bfloat16 and (300-1001 or 520-3000 or 64-64)) or (sddmm_tile_view_wgmma_tiles and bfloat16 and (300-1001 or 129-64))}" \
    tests/python/test_kernels_cuda.py || rc=1
  # The layer under autocast: the 16-bit products and the mixed-precision fused step.
  compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider \
    -k cuda tests/python/test_autocast.py || rc=1
  # The bad-input matrix on the GPU (its isolated cases run in child processes, which the sanitizer follows).
  compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 "$PY" -m pytest -q -x \
    -p no:cacheprovider -k cuda tests/python/test_bad_inputs.py || rc=1
  return $rc
}

example() {
  if [ -d .devbuild/install ]; then
    # The carried install names the build machine's libtorch: the example builds where snack does (CI).
    echo "the libtorch example is not built against a carried build"
    return 0
  fi
  local prefix; prefix=$("$PY" -c 'import torch, snack; print(torch.utils.cmake_prefix_path + ";" + snack.cmake_prefix_path)')
  cmake -S examples/cpp -B build/example -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null &&
    cmake --build build/example >/dev/null && ./build/example/train_sparse_linear
}

bench() {
  local rc=0
  IFS=';' read -ra cmds <<< "${SNACK_BENCH:-$PY bench/spmm.py --quick}"
  for c in "${cmds[@]}"; do echo "--- $c"; eval "$c --out $OUT" || rc=1; done
  return $rc
}

demo() {
  "$PY" -m snack.demo --epochs 20 &&
    "$PY" -m snack.demo --epochs 20 --dst set --no-dense &&
    "$PY" -m snack.demo --epochs 20 --dst rigl --no-dense
}

stage build build
stage ctest run_ctest
stage pytest timeout "${SNACK_PYTEST_TIMEOUT:-1800}" "$PY" -m pytest -q -ra -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
  ${SNACK_PYTEST_ARGS:-tests/python}
stage bench bench
stage sanitize timeout "${SNACK_SANITIZE_TIMEOUT:-1200}" bash -c "$(declare -f ctest_binary sanitize); PY=$PY; sanitize"
stage demo demo
stage example example

echo "=== failed stages: ${failed[*]:-none}" | tee -a "$LOG"
grep -E "^(=== |[0-9]+ passed|FAILED|ERROR)" "$LOG" | tail -40
[ ${#failed[@]} -eq 0 ]
