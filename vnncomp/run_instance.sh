#!/usr/bin/env bash
# VNN-COMP run_instance.sh v1 CATEGORY ONNX VNNLIB RESULTS_FILE TIMEOUT: one `fedshard verify` process, whose
# --timeout counts from that process's start (interpreter and imports included) and keeps a second for writing the
# answer, so the whole script returns within TIMEOUT. RESULTS_FILE's first line is always the verdict: sat (then the
# counterexample, ((X_0 v) ... (Y_j v)) with Y from onnxruntime, checked before it is written), unsat, unknown,
# timeout, or error (the files cannot be read, or the process failed; the reason is on stderr). Exit 0 whenever
# a verdict is written, so that the runner reads it; 1 for wrong arguments.
set -uo pipefail # no -e: a failing fedshard is answered "error", not passed on as the script's exit status
source "$(dirname "$0")/common.sh"
check_args "CATEGORY ONNX VNNLIB RESULTS_FILE TIMEOUT" 6 "$@"
# CATEGORY ($2) is accepted and ignored: every setting is chosen from the network itself (--bab auto, --refine
# auto), never from a category or a file name.
onnx=$3 vnnlib=$4 results=$5 timeout=$6

: >"$results" # the runner's "no_result_in_file" (or an older answer) must never pass for this run's verdict
# FEDSHARD_VERIFY_ARGS: extra flags for every instance (e.g. "--device auto" on a GPU machine), split into words.
# shellcheck disable=SC2086
"$FEDSHARD" verify "$onnx" "$vnnlib" --timeout "$timeout" --result "$results" ${FEDSHARD_VERIFY_ARGS-}
status=$?
verdict=$(head -n 1 "$results" 2>/dev/null)
case "$status:$verdict" in
0:sat | 0:unsat | 0:unknown | 0:timeout) ;;
*)
    echo "$(basename "$0"): fedshard verify exited with status $status and no verdict: answering error" >&2
    echo error >"$results" || exit 1
    ;;
esac
exit 0
