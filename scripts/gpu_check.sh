#!/usr/bin/env bash
# The GPU check (kvferry/tools/gpu_check): run on a CUDA machine, from the source tree, on that machine's own
# python3 (torch, triton and transformers already there; pyproject.toml's pins play no part). What that
# Python lacks travels as wheels in .gpu-check/, filled by `make gpu-check-prepare` on a machine with network.
#   scripts/gpu_check.sh OUTDIR [--parts a,b]   writes OUTDIR/report.json, report.txt and log.txt as each part
#                                               finishes (--parts: only those, to run some again)
set -euo pipefail

# The driver's parts end within 450 s of this moment (kvferry/tools/gpu_check/parts.py, BUDGET_S).
export KVFERRY_GPU_CHECK_STARTED="${KVFERRY_GPU_CHECK_STARTED:-$(date +%s)}"
OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
PREPARED="${KVFERRY_GPU_CHECK_PREPARED:-$ROOT/.gpu-check}"  # another folder: for testing this script
# The interpreter would run the kernels on the CPU and make graph capture impossible: never on the GPU.
unset TRITON_INTERPRET

# Stops before any part runs, saying why, on stderr and in OUTDIR/report.txt (which is what comes back).
give_up() {
    local message="gpu-check: FAILED: $1; nothing was run."
    mkdir -p "$OUT" && echo "$message" >"$OUT/report.txt"
    echo "$message" >&2
    exit 2
}
CARRY=".gpu-check/ must travel with the source tree (the device tool does not send ignored folders: carry: [\".gpu-check\"])"

# First, and fast: without a GPU nothing below means anything.
if [ -z "${KVFERRY_GPU_CHECK_ALLOW_CPU:-}" ]; then
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        give_up "no CUDA GPU visible to $PY (torch.cuda.is_available() is False, or torch is missing). This check needs a machine with an NVIDIA GPU"
    fi
fi

SITE="$(mktemp -d "${TMPDIR:-/tmp}/kvferry-gpu-check-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
shopt -s nullglob
WHEELS=("$PREPARED"/wheels/*.whl)
if [ ${#WHEELS[@]} -gt 0 ]; then
    if ! pip_error="$("$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$SITE" "${WHEELS[@]}" 2>&1)"; then
        give_up "the wheels in $PREPARED/wheels do not install on $PY (they are built for CPython 3.12 on x86-64
Linux): $(printf '%s' "$pip_error" | tail -c 1500)"
    fi
elif ! "$PY" -c 'import zmq, starlette, uvicorn, jsonschema' 2>/dev/null; then
    give_up "$PY lacks pyzmq, starlette, uvicorn or jsonschema and $PREPARED/wheels holds no wheels: run
\`make gpu-check-prepare\` on a machine with network; $CARRY"
fi
if [ ! -f "$PREPARED/model/config.json" ]; then
    give_up "$PREPARED/model/config.json is missing: run \`make gpu-check-prepare\` first; $CARRY"
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # the driver runs from the repository's root
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
# exec: a SIGTERM sent to this script reaches the driver, which then stops the running part, kills what it
# started and finishes the report. This shell's EXIT trap goes with it: the driver removes $SITE at its end.
trap - EXIT
export KVFERRY_GPU_CHECK_REMOVE="$SITE"
exec "$PY" -m kvferry.tools.gpu_check "$OUT" --prepared "$PREPARED" "${@:2}"
