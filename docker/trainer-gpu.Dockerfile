# AGL trainer, GPU image (preview). NOT BUILT OR RUN in this repository's CI (no GPU, and its CUDA base
# image comes from a registry the CI machines cannot reach): see docs/deploy.md, "Not verified here".
# The CPU trainer image, built and run in the tests, is docker/trainer.Dockerfile.
#
# Build context = the repository root:
#   docker build -f docker/trainer-gpu.Dockerfile -t agl-trainer-gpu .
#
# Two separate Python 3.11 environments, because their pins conflict (verl 0.9.1 needs
# transformers==5.9.0 and torch==2.11.0, agl-trainer needs transformers>=5.16 and torch==2.13.0):
#   /opt/verl  verl[vllm]==0.9.1, which pins vllm==0.24.0, torch==2.11.0 (CUDA 13.0 wheels);
#              the GPU engine (`vllm serve`) and the verl training backend
#   /opt/agl   agl-trainer and agl-common (CPU torch): rollouts, gateway pause/resume, the RL loop
# The verl backend that joins them is not in this release (README "Status").
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    UV_NO_CACHE=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_LINK_MODE=copy

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates git build-essential \
    && rm -rf /var/lib/apt/lists/*
COPY --from=ghcr.io/astral-sh/uv:0.9.5 /uv /usr/local/bin/uv

# 1. verl + vLLM (GPU)
RUN uv venv --python 3.11 /opt/verl \
    && uv pip install --python /opt/verl/bin/python "verl[vllm]==0.9.1"

# 2. agl-trainer (CPU torch from the PyTorch CPU index, so no second CUDA stack)
WORKDIR /opt/agl-src
COPY docker/constraints.txt /tmp/constraints.txt
COPY packages/common packages/common
COPY packages/trainer packages/trainer
RUN grep -v -e '^torch==' -e '^vllm' /tmp/constraints.txt > /tmp/constraints-agl.txt \
    && uv venv --python 3.11 /opt/agl \
    && uv pip install --python /opt/agl/bin/python --index-strategy unsafe-best-match \
        --extra-index-url https://download.pytorch.org/whl/cpu \
        -c /tmp/constraints-agl.txt "torch==2.13.0+cpu" ./packages/common ./packages/trainer \
    && rm -rf /opt/agl-src /tmp/constraints*.txt

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin agl
# agl-* on PATH; the verl environment is /opt/verl/bin (e.g. /opt/verl/bin/vllm serve ...).
ENV PATH=/opt/agl/bin:$PATH
WORKDIR /home/agl
USER 10001:10001

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import os, redis; redis.Redis.from_url(os.environ.get('AGL_REDIS_URL', 'redis://127.0.0.1:6379/0'), socket_timeout=3).ping()"

ENTRYPOINT ["agl-trainer"]
CMD ["--help"]
