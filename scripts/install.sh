#!/usr/bin/env bash
# Installs snack and its dependencies into the current Python environment (a fresh machine needs
# only Python 3.10+, a C++17 compiler and CMake; the CUDA toolkit to build the GPU kernels).
#   ./scripts/install.sh            # runtime + demo dependencies, then snack itself
#   SNACK_EXTRAS=test ./scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${SNACK_TORCH_SPEC:-torch==2.11.0}

# Same PyTorch as the lent H200 (2.11, CUDA 13.0): the extension builds the same way everywhere.
# pip's cache is reused, so the large wheels are downloaded at most once.
"$PY" -m pip install --upgrade-strategy only-if-needed "$TORCH_SPEC" numpy scikit-learn \
  "scikit-build-core>=0.10" cmake ninja ${SNACK_EXTRA_PACKAGES:-}
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
config=()
if [ -n "${SNACK_REQUIRE_CUDA:-}" ]; then config+=(--config-settings=cmake.define.SNACK_REQUIRE_CUDA=ON); fi
"$PY" -m pip install --no-build-isolation --no-deps "${config[@]}" .
