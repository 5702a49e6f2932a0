#!/usr/bin/env bash
# Start a Redis on 127.0.0.1:6379 unless one answers there already.
set -euo pipefail
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then exit 0; fi
if ! command -v redis-server >/dev/null; then
  echo "redis-server not found; installing it from Debian's packages" >&2
  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
fi
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --logfile /tmp/agl-redis.log
for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0; sleep 0.1; done
echo "redis did not start" >&2; exit 1
