#!/usr/bin/env bash
# Set up (first run only), then run the whole test suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup/setup.sh
# The playground test drives a real headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null
fi
. .venv/bin/activate
exec python -m pytest -q -rs --durations=15 "$@"
