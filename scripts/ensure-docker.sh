#!/usr/bin/env bash
# Make sure a Docker engine answers, starting one if none does; print the DOCKER_HOST to use (one line).
#
#   export DOCKER_HOST="$(bash scripts/ensure-docker.sh)"
#
# 1. $DOCKER_HOST, or the default socket, if an engine answers there: use it.
# 2. Else our own engine (AGL_DOCKER_DIR, default /var/lib/agl-docker; socket $AGL_DOCKER_DIR/docker.sock):
#    install Debian's docker.io if dockerd is missing, then start dockerd as root with its own data root,
#    exec root, socket and pid file, without iptables, IP forwarding, masquerading or a bridge (containers
#    and builds run with --network host; nothing leaves loopback), overlay2 storage. The engine keeps
#    running after this script and says so on stderr ("started dockerd (pid N, pid file F)"); stop it with
#    `kill "$(cat $AGL_DOCKER_DIR/dockerd.pid)"` (tests/dockerkit.py does at the end of the session). Its
#    images stay in the data root: the next start has them (the build cache between test steps and runs).
# Exit status 2 (and the reason on stderr) when no engine can run here (not root, no dockerd and no apt).
set -euo pipefail
DIR="${AGL_DOCKER_DIR:-/var/lib/agl-docker}"
SOCK="unix://$DIR/docker.sock"

answers() { DOCKER_HOST="$1" timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

if ! command -v docker >/dev/null; then
  NEED_CLIENT=1
else
  NEED_CLIENT=0
  if [ -n "${DOCKER_HOST:-}" ] && answers "$DOCKER_HOST"; then echo "$DOCKER_HOST"; exit 0; fi
  if answers unix:///var/run/docker.sock; then echo unix:///var/run/docker.sock; exit 0; fi
  if answers "$SOCK"; then echo "$SOCK"; exit 0; fi
fi

if [ "$(id -u)" != 0 ]; then
  echo "no Docker engine answers and starting one needs root" >&2; exit 2
fi
if ! command -v dockerd >/dev/null || [ "$NEED_CLIENT" = 1 ]; then
  if ! command -v apt-get >/dev/null; then echo "no dockerd and no apt-get to install docker.io" >&2; exit 2; fi
  echo "installing Debian's docker.io" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io) >&2 \
    || { echo "apt-get install docker.io failed" >&2; exit 2; }
fi

mkdir -p "$DIR/data" "$DIR/exec"
if [ -f "$DIR/dockerd.pid" ] && kill -0 "$(cat "$DIR/dockerd.pid")" 2>/dev/null; then
  echo "dockerd (pid $(cat "$DIR/dockerd.pid")) runs but does not answer on $SOCK" >&2; exit 2
fi
rm -f "$DIR/docker.sock" "$DIR/dockerd.pid"
# setsid: the engine outlives the shell (and the pytest process) that started it.
setsid dockerd --data-root "$DIR/data" --exec-root "$DIR/exec" -H "$SOCK" --pidfile "$DIR/dockerd.pid" \
  --iptables=false --ip-forward=false --ip-masq=false --bridge=none --storage-driver=overlay2 \
  >"$DIR/dockerd.log" 2>&1 < /dev/null &
for _ in $(seq 120); do
  if answers "$SOCK"; then echo "started dockerd (pid $(cat "$DIR/dockerd.pid"), pid file $DIR/dockerd.pid)" >&2; echo "$SOCK"; exit 0; fi
  sleep 0.5
done
echo "dockerd did not answer on $SOCK within 60 s; its log:" >&2
tail -20 "$DIR/dockerd.log" >&2
exit 2
