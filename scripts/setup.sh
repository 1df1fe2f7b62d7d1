#!/usr/bin/env bash
# Install everything moe_gemm needs on a fresh machine (idempotent; quick when done before).
# torch: the pinned CPU build (2.13.0) unless a torch is already importable (e.g. a CUDA build
# on a GPU machine, which we must not replace). Never an unpinned torch: that pulls GBs of CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if ! "$PY" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[dev,bench]" -e "./client" -e "./server[test]"
