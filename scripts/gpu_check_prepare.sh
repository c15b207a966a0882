#!/usr/bin/env bash
# Fills .gpu-check/ (ignored by git) for scripts/gpu_check.sh, here, on a machine with network and .venv:
# - wheels/: the packages kvferry needs that the GPU machine's Python 3.12 lacks, at the versions this .venv
#   runs, built for CPython 3.12 on manylinux x86-64 (no dependencies pulled: each missing one is named below);
# - model/: the default model's config and tokenizer, without its weights (they do not fit what travels):
#   the check builds SmolLM2 with random weights on the GPU machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
DEST="$ROOT/.gpu-check"
# Not on the GPU machine (its package list, /work/.library/device/KINDS.md) and needed by the stack:
# the transport, the gateway's HTTP server, and the gateway's schema checks with jsonschema's own needs.
# Not carried: gguf (only converts .gguf files), xgrammar (only structured output), honcho (only the Procfile).
PACKAGES=(pyzmq starlette uvicorn jsonschema jsonschema-specifications referencing rpds-py)
LIMIT_MIB=32  # what travels is capped at 64 MiB, the repository included

rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/model"

pins=()
for name in "${PACKAGES[@]}"; do
    pins+=("$name==$("$PY" -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$name")")
done
echo "gpu-check-prepare: downloading ${pins[*]}"
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$DEST/wheels" "${pins[@]}"

model_dir="$("$PY" -m kvferry.tools.cli prepare | tail -n 1)"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json \
    chat_template.jinja; do
    if [ -f "$model_dir/$f" ]; then cp "$model_dir/$f" "$DEST/model/"; fi
done

ls -l "$DEST/wheels" "$DEST/model"
prepared_kib=$(du -sk "$DEST" | cut -f1)
tree_kib=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null \
    | tail -n 1 | cut -f1)
echo "gpu-check-prepare: .gpu-check is $((prepared_kib / 1024)) MiB, the working tree that travels with it" \
    "$(((prepared_kib + tree_kib) / 1024)) MiB (the cap is 64 MiB)"
if [ "$prepared_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "gpu-check-prepare: FAILED: .gpu-check is over $LIMIT_MIB MiB" >&2
    exit 1
fi
