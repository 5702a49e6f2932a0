#!/usr/bin/env bash
# Set up and run the CPU main job (about 20-25 minutes on 2 cores, plus 3-4 minutes of vLLM warm-up the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/agl-trainer demo "$@"
