#!/usr/bin/env bash
# The GPU check (kvferry/tools/gpu_check): run on a CUDA machine, from the source tree, on that machine's own
# python3 (torch, triton and transformers already there; pyproject.toml's pins play no part). What that
# Python lacks travels as wheels in .gpu-check/, filled by `make gpu-check-prepare` on a machine with network.
#   scripts/gpu_check.sh OUTDIR [--parts a,b]   writes OUTDIR/report.json, report.txt and log.txt as each part
#                                               finishes (--parts: only those, to run some again)
set -euo pipefail

OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
PREPARED="${KVFERRY_GPU_CHECK_PREPARED:-$ROOT/.gpu-check}"  # another folder: for testing this script
# The interpreter would run the kernels on the CPU and make graph capture impossible: never on the GPU.
unset TRITON_INTERPRET

# First, and fast: without a GPU nothing below means anything.
if [ -z "${KVFERRY_GPU_CHECK_ALLOW_CPU:-}" ]; then
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        message="gpu-check: FAILED: no CUDA GPU visible to $PY (torch.cuda.is_available() is False, or torch is"
        message+=" missing). This check needs a machine with an NVIDIA GPU; nothing was run."
        mkdir -p "$OUT" && echo "$message" >"$OUT/report.txt"
        echo "$message" >&2
        exit 2
    fi
fi

SITE="$(mktemp -d "${TMPDIR:-/tmp}/kvferry-gpu-check-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
shopt -s nullglob
WHEELS=("$PREPARED"/wheels/*.whl)
if [ ${#WHEELS[@]} -gt 0 ]; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" \
        "${WHEELS[@]}"; then
        message="gpu-check: FAILED: the wheels in $PREPARED/wheels do not install on $PY (the lines above say why;"
        message+=" they are built for CPython 3.12 on x86-64 Linux)"
        mkdir -p "$OUT" && echo "$message" >"$OUT/report.txt"
        echo "$message" >&2
        exit 2
    fi
elif ! "$PY" -c 'import zmq, starlette, uvicorn, jsonschema' 2>/dev/null; then
    echo "gpu-check: FAILED: $PY lacks pyzmq, starlette, uvicorn or jsonschema and $PREPARED/wheels is empty:" \
        "run \`make gpu-check-prepare\` on a machine with network, and bring .gpu-check/ along." >&2
    exit 2
fi
if [ ! -f "$PREPARED/model/config.json" ]; then
    echo "gpu-check: FAILED: $PREPARED/model/config.json is missing: run \`make gpu-check-prepare\` first." >&2
    exit 2
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # the driver runs from the repository's root
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
"$PY" -m kvferry.tools.gpu_check "$OUT" --prepared "$PREPARED" "${@:2}"
