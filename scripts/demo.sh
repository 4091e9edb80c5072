#!/usr/bin/env bash
# Set up (first run only), then generate a reply to a built-in prompt with the default
# model and show its speed: Quasar mode against plain autoregressive decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup/setup.sh
. .venv/bin/activate
echo "== autoregressive, float verifier (none + fp) =="
quasar generate --drafter none --verifier fp "$@"
echo
echo "== Quasar (n-gram drafts + the default verifier: the file's own 4-bit weights, W4A8) =="
quasar generate "$@"
