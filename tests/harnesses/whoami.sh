#!/bin/sh
# tests/harnesses/whoami.py for exec mode, in sh (the other user may not reach the test's Python): AGL_INPUT is
# {"probe_out": PATH, "peer": PID, "private_file": PATH}, as JSON with no spaces.
field() { printf '%s' "$AGL_INPUT" | sed -n "s/.*\"$1\": *\"\{0,1\}\([^\",}]*\).*/\1/p"; }
out=$(field probe_out); peer=$(field peer); private=$(field private_file)
can() { if head -c1 "$1" >/dev/null 2>&1; then echo true; else echo false; fi; }
printf '{"uid": %s, "gid": %s, "groups": [%s], "home": "%s", "user": "%s", "peer_environ": %s, "private_file": %s}\n' \
  "$(id -u)" "$(id -g)" "$(id -G | tr ' ' '\n' | grep -vx "$(id -g)" | paste -sd, -)" "$HOME" "$USER" \
  "$(can /proc/$peer/environ)" "$(can "$private")" > "$out"
