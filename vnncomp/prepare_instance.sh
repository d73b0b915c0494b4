#!/usr/bin/env bash
# VNN-COMP prepare_instance.sh v1 CATEGORY ONNX VNNLIB, run before the clock starts: loads the model and the
# property and runs one forward pass (libraries, files and device warm for the timed run); analyses nothing.
# Exit 0 if the verifier takes the instance on; 3 if it does not (an unsupported operator or property: the runner
# then scores it unknown without running it); 2 if the files cannot be read; 1 for wrong arguments.
set -euo pipefail
source "$(dirname "$0")/common.sh"
check_args "CATEGORY ONNX VNNLIB" 4 "$@"
# CATEGORY ($2) is accepted and ignored: every setting is chosen from the network itself (--bab auto, --refine
# auto), never from a category or a file name.
# FEDSHARD_VERIFY_ARGS: extra flags for every instance (e.g. "--device auto" on a GPU machine), split into words.
# shellcheck disable=SC2086
exec "$FEDSHARD" verify "$3" "$4" --prepare ${FEDSHARD_VERIFY_ARGS-}
