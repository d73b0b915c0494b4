#!/usr/bin/env bash
# VNN-COMP install_tool.sh v1: the repository's own set-up (README "Set-up"): `make` creates .venv with the pinned
# torch (a CUDA build where the machine has a GPU) and `pip install -e ".[dev]"`, the LP/MILP extra included.
set -euo pipefail
source "$(dirname "$0")/common.sh"
check_args "" 1 "$@"
make -C "$REPO" .venv/.installed
"$REPO/.venv/bin/fedshard" verify --help >/dev/null
echo "installed: $REPO/.venv/bin/fedshard"
