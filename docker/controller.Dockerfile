# AGL controller: runs one harness process (local mode) or one Kubernetes Job (k8s mode) per queued rollout.
#
# Build context = the repository root (its .dockerignore sends only what the images copy):
#   docker build -f docker/controller.Dockerfile -t agl-controller .
# BASE_IMAGE: any image with python3 (3.11) and its venv module; default the official python:3.11-slim.
#
# In local mode the harness runs inside this container, so this image is a base: put your agent and its
# dependencies on top of it (docs/deploy.md), e.g.
#   FROM agl-controller
#   USER root
#   COPY my_agent/ /home/agl/my_agent/
#   RUN pip install -r /home/agl/my_agent/requirements.txt
#   USER 10001:10001
#   ENV AGL_COMMAND="python my_agent/agent.py"
# Usage: configured only by AGL_* environment variables (docs/configuration.md); arguments after the
# image name are `agl-controller run` flags:
#   docker run --rm agl-controller --help
#   docker run -d --network host -e AGL_COMMAND="python my_agent/agent.py" \
#     -e AGL_GATEWAY_URL=http://127.0.0.1:8080 -e AGL_REDIS_URL=redis://127.0.0.1:6379/0 my-harness
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin agl

# [k8s]: the Kubernetes client and Jinja2 for --mode k8s (the Job template of the Helm chart).
# pip stays in the environment: images built on this one install their harness with it.
COPY docker/constraints.txt /tmp/agl-src/constraints.txt
COPY packages/common /tmp/agl-src/common
COPY packages/controller /tmp/agl-src/controller
RUN python3 -m venv /opt/agl \
    && /opt/agl/bin/pip install -c /tmp/agl-src/constraints.txt /tmp/agl-src/common "/tmp/agl-src/controller[k8s]" \
    && rm -rf /tmp/agl-src \
    && find /opt/agl -name __pycache__ -prune -exec rm -rf {} +
ENV PATH=/opt/agl/bin:$PATH

# Harness logs go to AGL_LOG_DIR; the working directory is the harness's cwd.
ENV AGL_LOG_DIR=/home/agl/logs
WORKDIR /home/agl
USER 10001:10001

# The controller serves no HTTP. It is healthy while the Redis it works from answers.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD python -c "import os, redis; redis.Redis.from_url(os.environ.get('AGL_REDIS_URL', 'redis://127.0.0.1:6379/0'), socket_timeout=3).ping()"

ENTRYPOINT ["agl-controller", "run"]
