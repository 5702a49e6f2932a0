#!/usr/bin/env bash
# Set up and run the CPU main job: about 45 minutes on 2 cores (30 min of training, ~13 min of held-out evaluations,
# plus 1 min of vLLM warm-up, 3-4 min the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/agl-trainer demo "$@"
