# Sourced by the VNN-COMP scripts beside it: the argument check and the `fedshard` command they run.

# `fedshard` on PATH where there is one, else the venv that install_tool.sh (`make`) creates in the repository.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if command -v fedshard >/dev/null 2>&1; then
    FEDSHARD=fedshard
else
    FEDSHARD=$REPO/.venv/bin/fedshard
fi

# check_args USAGE COUNT "$@": the harness's version string "v1" first (anything else: exit 1, as the interface
# requires), then the rest of COUNT arguments.
check_args() {
    local usage=$1 count=$2
    shift 2
    if [ "${1-}" != v1 ]; then
        echo "$(basename "$0"): expected first argument (version string) 'v1', got '${1-}'" >&2
        exit 1
    fi
    if [ $# -ne "$count" ]; then
        echo "usage: $(basename "$0") v1 $usage" >&2
        exit 1
    fi
}
