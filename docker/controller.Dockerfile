# syntax=docker/dockerfile:1
# AGL controller: runs one harness process per queued rollout.
#
# Build context = the repository root:
#   docker build -f docker/controller.Dockerfile -t agl-controller .
# In local mode the harness runs inside this container, so this image is a base: put your agent
# and its dependencies on top of it, e.g.
#   FROM agl-controller
#   COPY --chown=10001:10001 my_agent/ /home/agl/my_agent/
#   RUN pip install --user -r /home/agl/my_agent/requirements.txt
# Configured only by AGL_* environment variables (docs/configuration.md); AGL_COMMAND is required.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin agl

WORKDIR /opt/agl
COPY requirements.txt /tmp/constraints.txt
COPY packages/common packages/common
COPY packages/controller packages/controller
# [k8s]: the Kubernetes client and Jinja2 for --mode k8s (the Job template of the Helm chart).
RUN pip install -c /tmp/constraints.txt ./packages/common "./packages/controller[k8s]" \
    && rm -rf /opt/agl/packages /tmp/constraints.txt

# Harness logs go to AGL_LOG_DIR; the working directory is the harness's cwd.
ENV AGL_LOG_DIR=/home/agl/logs
WORKDIR /home/agl
USER 10001:10001

# The controller serves no HTTP; the container ends when the process does.
HEALTHCHECK NONE

ENTRYPOINT ["agl-controller", "run"]
