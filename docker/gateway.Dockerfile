# AGL gateway: the OpenAI-compatible proxy that records every model call into Redis.
#
# Build context = the repository root (its .dockerignore sends only what the images copy):
#   docker build -f docker/gateway.Dockerfile -t agl-gateway .
#   docker build --build-arg BASE_IMAGE=my-python:3.11 -f docker/gateway.Dockerfile -t agl-gateway .
# BASE_IMAGE: any image with python3 (3.11) and its venv module; default the official python:3.11-slim.
#
# Usage: configured only by AGL_* environment variables (docs/configuration.md); arguments after the
# image name are `agl-gateway serve` flags:
#   docker run --rm agl-gateway --help
#   docker run -d --network host -e AGL_UPSTREAM=http://127.0.0.1:8000/v1 -e AGL_OPEN=true \
#     -e AGL_HOST=127.0.0.1 -e AGL_REDIS_URL=redis://127.0.0.1:6379/0 agl-gateway
# SIGTERM (docker stop): the gateway stops taking calls (503 shutting_down), lets running calls finish
# and record (at most 10 s), then exits 0; docker stop's default 10 s grace covers it.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin agl

# [otel]: the OpenTelemetry exporter (docs/operations.md). One virtual environment, /opt/agl: the same layout on any base (Debian's python3 forbids system installs).
# docker/constraints.txt pins every version to the tested environment (scripts/gen-constraints.sh).
COPY docker/constraints.txt /tmp/agl-src/constraints.txt
COPY packages/common /tmp/agl-src/common
COPY packages/gateway /tmp/agl-src/gateway
RUN python3 -m venv /opt/agl \
    && /opt/agl/bin/pip install -c /tmp/agl-src/constraints.txt /tmp/agl-src/common "/tmp/agl-src/gateway[otel]" \
    && /opt/agl/bin/pip uninstall -y pip setuptools \
    && rm -rf /tmp/agl-src \
    && find /opt/agl -name __pycache__ -prune -exec rm -rf {} +
ENV PATH=/opt/agl/bin:$PATH

# Listen on every interface inside the container; everything else keeps the code's defaults
# (AGL_REDIS_URL=redis://127.0.0.1:6379/0, AGL_PREFIX=agl:, AGL_MAX_HOLD=600).
ENV AGL_HOST=0.0.0.0 \
    AGL_PORT=8080

USER 10001:10001
WORKDIR /tmp
EXPOSE 8080

HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('AGL_PORT', '8080'), timeout=2)"

ENTRYPOINT ["agl-gateway", "serve"]
