#!/usr/bin/env bash
# Optional extra for `quasar bench`: the OpenVINO GenAI peers `openvino` and `openvino-pld`
# (quasar/bench/openvino.py). Without it the benchmark still runs and reports them as
# unavailable. About a minute from the package index; it ends by exporting the default model
# (cached in $QUASAR_CACHE/openvino) and decoding a few tokens with it.
#
# Two environments:
# - .venv (Quasar's, from scripts/setup/setup.sh) gets the runtime: openvino, openvino-tokenizers,
#   openvino-genai. None of them needs torch.
# - .venv-openvino-export (made here) gets the exporter, optimum-intel, which the bench runs
#   as a subprocess. It cannot share .venv: optimum-intel 2.2.0 wants transformers < 5.6 and
#   huggingface-hub < 1.22 (Quasar's .venv has newer ones), and it requires torchvision, whose
#   package-index build is made for CUDA torch and breaks `import transformers` next to the
#   CPU torch ("operator torchvision::nms does not exist"). So optimum-intel goes in without
#   its dependencies, and they are installed by name, torchvision left out (text models do
#   not use it), torch pinned to the CPU build on local disk.
#
# Usage: bash scripts/setup/install_openvino.sh   (after scripts/setup/setup.sh; safe to run again)
set -euo pipefail
cd "$(dirname "$0")/../.."

OPENVINO=2026.4.1
OPENVINO_TOKENIZERS=2026.4.1.0
OPENVINO_GENAI=2026.4.1.0
OPTIMUM_INTEL=2.2.0
OPTIMUM=2.3.0
NNCF=3.4.0
EXPORT_TRANSFORMERS=5.5.4
EXPORT_HF_HUB=1.21.0
TORCH=2.13.0
EXPORT_ENV=.venv-openvino-export
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "no .venv here: run scripts/setup/setup.sh first" >&2
  exit 1
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
quiet() {  # run a pip step; show its output only if it fails
  if ! "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2
    echo "install_openvino failed: $*" >&2
    exit 1
  fi
}
want="$(sha256sum scripts/setup/install_openvino.sh | cut -c1-16)"

# --- the runtime, in .venv
if [ "$(cat .venv/.quasar-openvino 2>/dev/null)" != "$want" ]; then
  echo "installing openvino-genai $OPENVINO_GENAI into .venv..." >&2
  quiet .venv/bin/pip install "openvino==$OPENVINO" "openvino-tokenizers==$OPENVINO_TOKENIZERS" \
    "openvino-genai==$OPENVINO_GENAI" "torch==$TORCH"
  .venv/bin/python -c "import openvino_genai, torch; assert torch.__version__.startswith('$TORCH'), torch.__version__"
  echo "$want" > .venv/.quasar-openvino
fi

# --- the exporter, in its own environment
if [ "$(cat "$EXPORT_ENV/.quasar-openvino" 2>/dev/null)" != "$want" ]; then
  echo "making $EXPORT_ENV with optimum-intel $OPTIMUM_INTEL (first run only)..." >&2
  if [ ! -x "$EXPORT_ENV/bin/python" ]; then
    "$PY" -m venv "$EXPORT_ENV"
  fi
  quiet "$EXPORT_ENV/bin/pip" install --upgrade pip
  quiet "$EXPORT_ENV/bin/pip" install "torch==$TORCH" "transformers==$EXPORT_TRANSFORMERS" \
    "huggingface-hub==$EXPORT_HF_HUB" "optimum==$OPTIMUM" "nncf==$NNCF" "openvino==$OPENVINO" \
    "openvino-tokenizers[transformers]==$OPENVINO_TOKENIZERS" setuptools "requests>=2.33,<3"
  quiet "$EXPORT_ENV/bin/pip" install --no-deps "optimum-intel==$OPTIMUM_INTEL"
  if "$EXPORT_ENV/bin/python" -c "import torchvision" 2>/dev/null; then
    quiet "$EXPORT_ENV/bin/pip" uninstall -y torchvision  # see the top of this file
  fi
  "$EXPORT_ENV/bin/python" - <<EOF
import torch, transformers
from optimum.exporters.openvino import main_export  # noqa: F401  (the import that torchvision broke)
assert torch.__version__.startswith("$TORCH"), torch.__version__
print(f"exporter ready: torch {torch.__version__}, transformers {transformers.__version__}")
EOF
  echo "$want" > "$EXPORT_ENV/.quasar-openvino"
fi

# --- the check: export the default model (once; cached) and decode a few tokens with both peers
.venv/bin/python - <<'EOF'
from quasar.api import LLM
from quasar.bench.openvino import OpenVINOPeer

llm = LLM("default", threads=2)
prompt = llm.encode([{"role": "user", "content": "Write a Python function that adds two numbers."}])
for name in ("openvino", "openvino-pld"):
    peer = OpenVINOPeer(name, llm.loaded.model_dir, threads=2, eos_ids=set(llm.tokenizer.eos_ids))
    peer.prepare()
    out = peer.run(prompt, 8)
    assert out.new_tokens > 0 and out.decode_s >= 0, out
    print(f"{name}: {llm.tokenizer.decode(out.token_ids)!r}")
print(f"OpenVINO peers ready ({peer.weights}): quasar bench --peers openvino,openvino-pld")
EOF
