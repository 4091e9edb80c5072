#!/usr/bin/env bash
# Set up (first run only), then run the whole test suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -rs "$@"
