# AGL trainer, CPU image: agl-trainer with CPU torch (the CPU LoRA backend); no CUDA package, no vLLM.
# It trains against an engine, gateway and Redis it is given (TrainConfig engine_url, gateway_url,
# redis_url). The GPU image with verl is docker/trainer-gpu.Dockerfile.
#
# Build context = the repository root (its .dockerignore sends only what the images copy):
#   docker build -f docker/trainer.Dockerfile -t agl-trainer .
# BASE_IMAGE: any image with python3 (3.11) and its venv module; default the official python:3.11-slim.
# TORCH_INDEX_URL: where the CPU build of torch comes from (PyPI's torch wheels are CUDA builds).
#
# Usage (arguments are `agl-trainer` commands):
#   docker run --rm agl-trainer --help
#   docker run --rm --network host -v $PWD/train.yaml:/etc/agl/train.yaml:ro -v $PWD/runs:/home/agl/runs \
#     agl-trainer train /etc/agl/train.yaml
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin agl

# "torch==2.13.0+cpu" (pinned in docker/constraints.txt too): the "+cpu" local version exists only on the
# CPU index, so no CUDA build can be picked; the check after the install makes sure.
COPY docker/constraints.txt /tmp/agl-src/constraints.txt
COPY packages/common /tmp/agl-src/common
COPY packages/trainer /tmp/agl-src/trainer
RUN python3 -m venv /opt/agl \
    && /opt/agl/bin/pip install --extra-index-url "$TORCH_INDEX_URL" -c /tmp/agl-src/constraints.txt \
        "torch==2.13.0+cpu" /tmp/agl-src/common /tmp/agl-src/trainer \
    && /opt/agl/bin/python -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'" \
    && ! /opt/agl/bin/pip list --format=freeze | grep -iE '^(nvidia-|triton|vllm)' \
    && rm -rf /tmp/agl-src \
    && find /opt/agl -name __pycache__ -prune -exec rm -rf {} +
# pip stays: images built on this one (docker/vllm-cpu.Dockerfile) install into /opt/agl with it.
ENV PATH=/opt/agl/bin:$PATH

WORKDIR /home/agl
USER 10001:10001

# A training job serves no HTTP. It is healthy while the Redis it records to answers (AGL_REDIS_URL, or
# the default the trainer uses).
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import os, redis; redis.Redis.from_url(os.environ.get('AGL_REDIS_URL', 'redis://127.0.0.1:6379/0'), socket_timeout=3).ping()"

ENTRYPOINT ["agl-trainer"]
CMD ["--help"]
