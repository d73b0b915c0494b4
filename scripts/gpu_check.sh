#!/usr/bin/env bash
# Every GPU check of the package in one run (see lightning_fedshard/bench/gpu_check.py): under 8 minutes, a JSON
# and a Markdown summary in $OUT (or the folder given as $1, else ./gpu-check). Without CUDA it runs nothing,
# says so and exits 0.
#
# Runs with the machine's python3 (or $PYTHON) and this working tree first on PYTHONPATH. Optional, carried
# beside the tree on a machine without a package index:
#   .whl/*.whl   wheels of missing packages (scripts/gpu_wheels.sh downloads highspy, for MILP refinement, and
#                torchao, for the float8 Llama check)
#   .vnncomp/    a copy of ../shared/vnncomp (the verifier check's benchmark files)
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${1:-${OUT:-$ROOT/gpu-check}}"
mkdir -p "$OUT_DIR"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    SITE="$(mktemp -d /tmp/gpu-check-site.XXXXXX)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$ROOT"/.whl/*.whl \
        || echo "gpu_check.sh: installing .whl/ failed; the checks run without those packages" >&2
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
cd "$ROOT"
# The module keeps its own budget (450 s); this outer limit only catches a hang of the module itself.
# Run as a script, not with -m: a machine without CUDA then imports torch alone, not the whole package.
timeout -k 10 470 "$PYTHON" lightning_fedshard/bench/gpu_check.py --out "$OUT_DIR"
