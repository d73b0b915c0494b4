#!/usr/bin/env bash
# Run here (with a package index), before a GPU run: puts into .whl/ the wheels of what the GPU image lacks and
# the checks use (highspy, for the verifier's MILP refinement; torchao, for the float8 Llama check), and copies
# ../shared/vnncomp into .vnncomp/. Both folders are git-ignored; name them in the device run's `carry`.
set -eu
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl highspy==1.16.0 torchao==0.18.0
if [ -d "$ROOT/../shared/vnncomp" ]; then
    rm -rf .vnncomp && cp -r "$ROOT/../shared/vnncomp" .vnncomp
fi
du -sh .whl .vnncomp 2>/dev/null || true
