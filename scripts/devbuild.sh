#!/usr/bin/env bash
# Builds on this machine what scripts/gpu_check.sh runs on a GPU machine, into .devbuild/ (ignored by
# git): the operator library, the C++ test binary and an install tree for the libtorch example. A GPU
# machine then needs no build of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
prefix=$("$PY" -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B build/devbuild -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DSNACK_REQUIRE_CUDA=ON -DSNACK_BUILD_TESTS=ON >/dev/null
cmake --build build/devbuild
rm -rf .devbuild
mkdir -p .devbuild
cmake --install build/devbuild --prefix .devbuild/install >/dev/null  # lib/, include/, share/cmake/
cp build/devbuild/tests/cpp/snack_core_tests .devbuild/
strip --strip-debug .devbuild/snack_core_tests .devbuild/install/lib/libsnack_torch.so
# The fuzzers' packages, for a GPU machine without network, built for its Python (3.12 on the lent H200s).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${SNACK_DEVICE_PYTHON:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .devbuild/wheels hypothesis attrs sortedcontainers
du -sh .devbuild
