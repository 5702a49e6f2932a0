#!/usr/bin/env bash
# Set-up of the dashboard's browser tests (pytest -m browser): Playwright for Python, pinned in requirements.txt,
# driving Debian's chromium package. Never `playwright install` (no browser download from anywhere else).
# Idempotent; the browser tests call it themselves. Needs root (or sudo) once, for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=$(grep -E '^playwright==' requirements.txt)
if ! .venv/bin/python -c "import playwright.sync_api" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "$PIN"
fi
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "chromium is missing and installing it needs root: apt-get install chromium" >&2; exit 1; }
    SUDO="sudo -n"
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null
fi
echo "browser set-up ok: $(/usr/bin/chromium --version 2>/dev/null | head -1), $(.venv/bin/python -c 'import importlib.metadata as m; print("playwright", m.version("playwright"))')"
