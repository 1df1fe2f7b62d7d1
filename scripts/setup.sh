#!/usr/bin/env bash
# Install moe_gemm, its service and client, and the test and benchmark tools into one Python
# environment: $PYTHON (default python3; the Makefile passes its project venv's python).
#
# torch first, by scripts/install_torch.py: an installed torch is kept; a machine with an
# NVIDIA GPU gets torch 2.13.0 from the configured index (the CUDA build); one without gets
# the CPU-only build from PyTorch's CPU index, or from the configured index where that index
# cannot be reached. Then the three packages, editable, with their extras: pip leaves the torch
# of step one alone since it satisfies "torch>=2.9".
#
#   bash scripts/setup.sh            install
#   bash scripts/setup.sh --dry-run  print what would be installed, install nothing
#
# The Makefile runs this only when a packaging file changed (its stamp); run it directly to
# install again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (known: --dry-run)" >&2; exit 2 ;;
  esac
done

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup.sh: $PY is not Python >= 3.10 (moe_gemm needs 3.10 or newer)" >&2
  exit 2
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "setup.sh: $PY has no pip (Debian/Ubuntu: apt install python3-pip python3-venv)" >&2
  exit 2
fi

TORCH_ARGS=()
[ "$DRY_RUN" = 1 ] && TORCH_ARGS+=(--dry-run)
"$PY" scripts/install_torch.py "${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"}"

PIP=("$PY" -m pip install -q --disable-pip-version-check
     -e ".[dev,bench]" -e "./client" -e "./server[test]")
if [ "$DRY_RUN" = 1 ]; then
  echo "packages: would run: ${PIP[*]}"
  exit 0
fi
echo "packages: installing moe_gemm, moe_gemm_server and moe_gemm_client (editable) with" \
     "their test and benchmark extras"
"${PIP[@]}"
