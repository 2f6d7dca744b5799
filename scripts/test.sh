#!/usr/bin/env bash
# Installs everything the tests need, builds snack, then runs the C++ tests (ctest), the libtorch
# example, the Python tests (pytest) and a short run of the demo. GPU tests run when a GPU is
# present and are skipped otherwise. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# hypothesis: the fuzzers (tests/python/fuzz_cases.py). transformers and networkx: only the end-to-end
# examples (and their tiny test runs) use them.
export SNACK_EXTRA_PACKAGES="pytest expecttest hypothesis matplotlib tqdm transformers networkx ${SNACK_EXTRA_PACKAGES:-}"

if [ ! -e /usr/include/gtest/gtest.h ] && [ ! -e /usr/local/include/gtest/gtest.h ]; then
  echo "== installing GoogleTest"
  apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
fi

echo "== installing snack and its dependencies"
./scripts/install.sh

if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cuda_flag=()
if [ -n "${SNACK_REQUIRE_CUDA:-}" ]; then cuda_flag=(-DSNACK_REQUIRE_CUDA=ON); fi

echo "== C++ core tests (GoogleTest)"
cmake -S . -B build/ctest -G Ninja -DSNACK_BUILD_TESTS=ON -DSNACK_BUILD_TORCH=OFF "${cuda_flag[@]}" >/dev/null
cmake --build build/ctest
ctest --test-dir build/ctest --output-on-failure

echo "== C++ core tests, CPU-only build (no CUDA compiler used)"
cmake -S . -B build/ctest-cpu -G Ninja -DSNACK_BUILD_TESTS=ON -DSNACK_BUILD_TORCH=OFF -DSNACK_ENABLE_CUDA=OFF >/dev/null
cmake --build build/ctest-cpu
ctest --test-dir build/ctest-cpu --output-on-failure

echo "== libtorch example against the installed package"
prefix=$("$PY" -c 'import torch, snack; print(torch.utils.cmake_prefix_path + ";" + snack.cmake_prefix_path)')
cmake -S examples/cpp -B build/example -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/example
./build/example/train_sparse_linear

echo "== Python tests"
"$PY" -m pytest -q -ra tests/python

echo "== demo (short runs)"
"$PY" -m snack.demo --epochs 2 --hidden 128
"$PY" -m snack.demo --epochs 2 --hidden 128 --dst rigl --no-dense
