#!/usr/bin/env bash
# Build a Python 3.11 base image from Debian's packages, for machines that reach no container registry
# (the images' default base, python:3.11-slim, is pulled from Docker Hub). Test use: the image also trusts
# this machine's CA certificates (pip inside a build reaches PyPI only through them).
#
#   bash scripts/build-base-image.sh [TAG]      # prints the tag; default agl-base:bookworm-<hash of this script>
#   docker build --build-arg BASE_IMAGE="$TAG" -f docker/gateway.Dockerfile -t agl-gateway .
#
# Needs root, debootstrap (installed from Debian's packages if missing) and a Docker engine at $DOCKER_HOST.
# An image of that tag already in the engine is reused (built once per engine, i.e. once per CI run).
# What it is: `debootstrap --variant=minbase bookworm` + python3, python3-venv, ca-certificates (Debian 12's
# Python is 3.11), imported with `docker import` (~1.5 min, ~150 MB).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CERTS="${SSL_CERT_FILE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
HASH="$( (cat "$0"; [ -f "$CERTS" ] && cat "$CERTS") | sha256sum | cut -c1-12)"
TAG="${1:-agl-base:bookworm-$HASH}"
if docker image inspect "$TAG" >/dev/null 2>&1; then echo "$TAG"; exit 0; fi

if ! command -v debootstrap >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap) >&2
fi
# The Debian mirror apt uses here (deb822 or one-line sources), else the default one.
MIRROR="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | grep -E '^(deb |URIs:)' | grep -oE 'https?://[^ ]+' | grep -v security | head -1 || true)"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

ROOTFS="$(mktemp -d /var/tmp/agl-base.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap bookworm from $MIRROR into $ROOTFS" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR" \
  >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
# Test only: trust what this machine trusts (pip reads PIP_CERT, Python's ssl SSL_CERT_FILE).
if [ -f "$CERTS" ]; then cp "$CERTS" "$ROOTFS/usr/local/share/agl-ca-certificates.crt"; fi
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
  "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV SSL_CERT_FILE=/usr/local/share/agl-ca-certificates.crt' \
  --change 'ENV PIP_CERT=/usr/local/share/agl-ca-certificates.crt' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "$TAG"
