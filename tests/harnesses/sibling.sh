#!/bin/sh
# A run-as probe (tests/test_hostile20.py), in sh: the other user may not reach the test's Python. In $PROBE_DIR it
# writes its uid and pid, leaves a child that quits its process group, waits for a sibling run (unless $ALONE) and
# writes whether it could read that run's environment or signal it ("reached") or not ("unreadable").
d="$PROBE_DIR"
id -u > "$d/$AGL_ROLLOUT_ID.uid"
echo $$ > "$d/$AGL_ROLLOUT_ID.pid"
setsid sleep 300 < /dev/null > /dev/null 2>&1 &
[ -n "$ALONE" ] && exit 0
other=""
for i in $(seq 100); do
  other=$(ls "$d" | grep '\.pid$' | grep -vx "$AGL_ROLLOUT_ID.pid" | head -n 1)
  [ -n "$other" ] && break
  sleep 0.05
done
pid=$(cat "$d/$other")
if head -c1 "/proc/$pid/environ" > /dev/null 2>&1 || kill -0 "$pid" 2> /dev/null; then
  echo reached > "$d/$AGL_ROLLOUT_ID.sibling"
else
  echo unreadable > "$d/$AGL_ROLLOUT_ID.sibling"
fi
sleep 1.5
