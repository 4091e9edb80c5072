#!/usr/bin/env bash
# Create .venv and install Quasar with everything its demo and tests need, at the versions
# pinned in constraints.txt (see scripts/setup/refresh_pins.sh). Idempotent: a later run only
# checks a stamp. Works offline from the package index mirror.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/setup/environment.sh
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.quasar-setup
want="$(cat pyproject.toml requirements-test.txt constraints.txt scripts/setup/setup.sh scripts/setup/environment.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv (first run only)..." >&2
install_quasar_env pip -c constraints.txt
python -c "import torch, quasar; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
