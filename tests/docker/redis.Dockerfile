# Test only: a Redis image from Debian's packages (no container registry is reachable on the CI machines,
# so compose.yaml's default redis:7.4 cannot be pulled there). Runs like the official image: redis-server
# as user redis, data in /data.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
CMD ["redis-server"]
