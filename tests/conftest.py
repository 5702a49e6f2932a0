"""Shared fixtures: a real Redis (127.0.0.1:6379 unless AGL_TEST_REDIS_URL), one fresh key prefix per test."""

from __future__ import annotations

import os
import uuid

import pytest
import redis

REDIS_URL = os.environ.get("AGL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:  # .ci/run starts one; a developer must too
        pytest.fail(f"tests need a Redis server at {REDIS_URL}: {exc}")
    return REDIS_URL


@pytest.fixture
def prefix(redis_url):
    p = f"test-{uuid.uuid4().hex[:8]}:"
    yield p
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=p + "*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture
async def store(redis_url, prefix):
    from agl_common.store import Store

    s = Store(redis_url, prefix)
    yield s
    await s.close()
