#!/bin/sh
# A run-as probe (tests/test_hostile20.py), in sh: writes this run's NoNewPrivs flag (/proc/self/status) to $PROBE_DIR.
grep NoNewPrivs /proc/self/status | tr -d ' \t' > "$PROBE_DIR/$AGL_ROLLOUT_ID.nnp"
