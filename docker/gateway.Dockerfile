# syntax=docker/dockerfile:1
# AGL gateway: the OpenAI-compatible proxy that records every model call into Redis.
#
# Build context = the repository root:
#   docker build -f docker/gateway.Dockerfile -t agl-gateway .
# Configured only by AGL_* environment variables (docs/configuration.md), e.g.
#   docker run --rm --network host -e AGL_UPSTREAM=http://127.0.0.1:8000/v1 -e AGL_OPEN=true agl-gateway
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin agl

WORKDIR /opt/agl
# requirements.txt is only a constraints file here: the versions the test suite ran with.
COPY requirements.txt /tmp/constraints.txt
COPY packages/common packages/common
COPY packages/gateway packages/gateway
RUN pip install -c /tmp/constraints.txt ./packages/common "./packages/gateway[otel]" \
    && rm -rf /opt/agl/packages /tmp/constraints.txt

# Listen on every interface inside the container; everything else keeps the code's defaults
# (AGL_REDIS_URL=redis://127.0.0.1:6379/0, AGL_PREFIX=agl:, AGL_MAX_HOLD=600).
ENV AGL_HOST=0.0.0.0 \
    AGL_PORT=8080

USER 10001:10001
EXPOSE 8080

HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('AGL_PORT', '8080'), timeout=2)"

ENTRYPOINT ["agl-gateway", "serve"]
