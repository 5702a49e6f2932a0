"""Security of the gateway as deployed (``python -m agl_gateway serve --key ...`` subprocess, real HTTP).

- A rollout-scoped key can call, reward and post events for its own rollout attempt only (both tagging
  forms, every model route, ``x-api-key`` too); ``--open`` creates rollouts only for a valid key.
- Without a key only ``/healthz``, ``/readyz`` and ``/metrics`` answer.
- Secrets (the admin key, scoped keys, whatever an agent sends in ``Authorization`` / ``x-api-key``) never
  reach Redis (records, events, rollouts), the gateway's logs (stdout+stderr at debug level), ``/metrics``,
  or the upstream engine.
- Sizes are bounded: 413 over ``--max-body-bytes`` (with or without Content-Length); a huge header gets a
  4xx or a closed connection, and the gateway keeps serving.

Reading what was recorded has no HTTP route at all (the trainer reads Redis directly): that is asserted
too, so protecting Redis (network policy, ``requirepass``/ACL) is what protects the records.
"""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest
import redis
from agl_common.auth import scoped_key
from agl_common.schemas import Rollout, RolloutStatus
from fakes import Served, fake_upstream
from test_reliability import GatewayProc

ADMIN = "adm1n-" + uuid.uuid4().hex
BOGUS = "bogus-secret-" + uuid.uuid4().hex
MAX_BODY = 4096


@pytest.fixture(scope="module")
def deployed(redis_url, tmp_path_factory):
    prefix = f"test-sec-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(redis_url)
    for rid, attempt in (("r1", "0"), ("r2", "0"), ("r3", "1")):
        r.set(prefix + "rollout:{" + rid + "}", Rollout(rollout_id=rid, attempt_id=attempt,
                                                 status=RolloutStatus.running).model_dump_json())
    log = tmp_path_factory.mktemp("sec") / "gateway.log"
    with Served(fake_upstream(model="up")) as ups:  # keeps every header and body it receives (``requests``)
        gw = GatewayProc(ups.url, redis_url, prefix, "gw-sec", log,
                         extra=["--key", ADMIN, "--open", "--max-body-bytes", str(MAX_BODY), "--log-level", "debug"])
        gw.start()
        # The first translated call waits for LiteLLM's import (seconds; minutes at nice 19 on a busy
        # machine): made here with a bound for an import that never ends, so the 30 s windows below are
        # about each answer, not the import.
        httpx.post(f"{gw.url}/rollouts/warm/attempts/0/v1/messages/count_tokens", json=BODIES["messages/count_tokens"],
                   headers=auth(ADMIN, anthropic=True), timeout=600)
        try:
            yield gw, ups.app.state, r, prefix, log
        finally:
            gw.stop()
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)


def auth(key: str | None, anthropic: bool = False) -> dict:
    if key is None:
        return {}
    return {"x-api-key": key} if anthropic else {"Authorization": f"Bearer {key}"}


BODIES = {
    "chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "m", "prompt": "hi"},
    "messages": {"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    "messages/count_tokens": {"model": "c", "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "m", "input": "hi"},
}


def requests_for(base: str, rid: str, aid: str):
    """(method, url, headers, json) of every keyed route for rollout attempt rid/aid, in both forms."""
    for route, body in BODIES.items():
        yield "POST", f"{base}/rollouts/{rid}/attempts/{aid}/v1/{route}", {}, body
        yield "POST", f"{base}/v1/{route}", {"X-AGL-Rollout-Id": rid, "X-AGL-Attempt-Id": aid}, body
    yield "GET", f"{base}/rollouts/{rid}/attempts/{aid}/v1/models", {}, None
    yield "POST", f"{base}/rollouts/{rid}/attempts/{aid}/reward", {}, {"value": 1.0}
    yield "POST", f"{base}/rollouts/{rid}/attempts/{aid}/events", {}, {"type": "t", "data": {"k": 1}}


def send(c: httpx.Client, method, url, headers, body, key, anthropic=False):
    return c.request(method, url, headers={**headers, **auth(key, anthropic)}, json=body)


def test_scoped_key_reaches_only_its_own_rollout_attempt(deployed):
    gw, _, r, prefix, _ = deployed
    mine = scoped_key(ADMIN, "r1", "0")
    with httpx.Client(timeout=30) as c:
        for method, url, headers, body in requests_for(gw.url, "r1", "0"):
            for anthropic in (False, True):
                resp = send(c, method, url, headers, body, mine, anthropic)
                assert resp.status_code == 200, (url, anthropic, resp.text[:300])
        # other rollouts, other attempts of the same rollout, rollouts that do not exist yet (--open)
        for rid, aid in (("r2", "0"), ("r1", "1"), ("r3", "1"), ("r3", "0"), ("new-one", "0")):
            for method, url, headers, body in requests_for(gw.url, rid, aid):
                resp = send(c, method, url, headers, body, mine)
                assert resp.status_code == 401, (rid, aid, url, resp.status_code, resp.text[:200])
        # the header form without an attempt acts for the attempt its key is for: r3's current one is 1, so a
        # key for r3/0 is that earlier attempt's late call (409, as the path form answers it), a key for r1/0 a 401
        resp = c.post(f"{gw.url}/v1/chat/completions", json=BODIES["chat/completions"],
                      headers={"X-AGL-Rollout-Id": "r3", **auth(scoped_key(ADMIN, "r3", "0"))})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "stale_attempt", resp.text[:200]
        resp = c.post(f"{gw.url}/v1/chat/completions", json=BODIES["chat/completions"],
                      headers={"X-AGL-Rollout-Id": "r3", **auth(mine)})
        assert resp.status_code == 401
        resp = c.post(f"{gw.url}/v1/chat/completions", json=BODIES["chat/completions"],
                      headers={"X-AGL-Rollout-Id": "r3", **auth(scoped_key(ADMIN, "r3", "1"))})
        assert resp.status_code == 200
        # a header naming another rollout than the path gets the key nowhere: refused (400 conflicting_ids, round 11)
        resp = c.post(f"{gw.url}/rollouts/r2/attempts/0/v1/chat/completions", json=BODIES["chat/completions"],
                      headers={"X-AGL-Rollout-Id": "r1", "X-AGL-Attempt-Id": "0", **auth(mine)})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "conflicting_ids", resp.text[:200]
        # a key derived from another secret, and a scoped key of another rollout, are refused
        assert send(c, "POST", f"{gw.url}/rollouts/r1/attempts/0/reward", {}, {"value": 0},
                    scoped_key("other-secret", "r1", "0")).status_code == 401
    assert r.get(prefix + "rollout:{new-one}") is None, "--open created a rollout for an invalid key"
    assert Rollout.model_validate_json(r.get(prefix + "rollout:{r2}")).reward is None
    assert r.xlen(prefix + "calls:{r2}") == 0 and r.xlen(prefix + "events:{r2}") == 0
    # the admin key may do anything, and --open creates rollouts for it
    with httpx.Client(timeout=30) as c:
        for method, url, headers, body in requests_for(gw.url, "r2", "0"):
            assert send(c, method, url, headers, body, ADMIN).status_code == 200
        resp = c.post(f"{gw.url}/rollouts/by-admin/attempts/0/v1/chat/completions",
                      json=BODIES["chat/completions"], headers=auth(ADMIN))
        assert resp.status_code == 200 and r.get(prefix + "rollout:{by-admin}") is not None


def test_a_key_outside_ascii_is_refused_not_a_500(deployed):
    """Header bytes outside ASCII (Latin-1 text to the server) in either key header: 401, never a 500."""
    gw = deployed[0]
    url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
    with httpx.Client(timeout=30) as c:
        for headers in ({"Authorization": b"Bearer \xe9"}, {"x-api-key": b"\xff"},
                        {"Authorization": "Bearer ".encode() + ADMIN.encode() + b"\xc3\xa9"}):
            resp = c.post(url, json=BODIES["chat/completions"], headers=headers)
            assert resp.status_code == 401, (headers, resp.status_code, resp.text[:200])
            assert resp.json()["error"]["code"] == "invalid_api_key"


def test_an_admin_key_outside_ascii_is_refused_at_start():
    """No client could present it (HTTP header values are ASCII tokens): a usage error, not a gateway on
    which every authenticated call fails."""
    from typer.testing import CliRunner

    from agl_gateway import cli

    result = CliRunner().invoke(cli.app, ["serve", "--key", "s\u00ebkret", "--port", "1"])
    assert result.exit_code == 2 and "admin key" in result.output


def test_only_health_ready_and_metrics_answer_without_a_key(deployed):
    gw, _, _, _, _ = deployed
    with httpx.Client(timeout=30) as c:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert c.get(gw.url + path).status_code == 200, path
        for method, url, headers, body in requests_for(gw.url, "r1", "0"):
            for key in (None, "x", BOGUS):
                resp = c.request(method, url, json=body, headers={
                    **headers, **({"Authorization": f"Bearer {key}"} if key is not None else {})})
                assert resp.status_code == 401, (url, key, resp.status_code, resp.text[:200])
                err = resp.json()["error"]
                assert err["type"] in ("authentication_error",) and err["message"]
        assert c.get(f"{gw.url}/v1/models").status_code == 401
        assert c.get(f"{gw.url}/v1/models", headers={"Authorization": "Basic " + ADMIN}).status_code == 401
        # there is no HTTP route that reads records or rollouts back, with or without a key
        for path in ("/rollouts/r1", "/rollouts/r1/attempts/0", "/rollouts/r1/attempts/0/calls",
                     "/rollouts", "/v1/rollouts/r1", "/calls/r1"):
            assert c.get(gw.url + path, headers=auth(ADMIN)).status_code in (404, 405), path


def test_secrets_never_reach_records_events_logs_metrics_or_the_engine(deployed):
    gw, up, r, prefix, log = deployed
    mine = scoped_key(ADMIN, "r1", "0")
    with httpx.Client(timeout=30) as c:
        for key in (ADMIN, mine):
            for anthropic in (False, True):
                for method, url, headers, body in requests_for(gw.url, "r1", "0"):
                    send(c, method, url, headers, body, key, anthropic)
        for method, url, headers, body in requests_for(gw.url, "r1", "0"):  # refused, but logged?
            send(c, method, url, headers, body, BOGUS)
            send(c, method, url, headers, body, BOGUS, anthropic=True)
        c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", content=b"{bad json",
               headers=auth(ADMIN))
        metrics = c.get(gw.url + "/metrics").text
    secrets = [ADMIN, mine, BOGUS]
    engine_saw = [repr(headers).encode() + raw for headers, raw in up.requests]
    dump = []
    for key in r.scan_iter(match=prefix + "*", count=1000):
        kind = r.type(key)
        if kind == b"string":
            dump.append(r.get(key))
        elif kind == b"stream":
            dump += [v for _, fields in r.xrange(key) for v in fields.values()]
        elif kind == b"list":
            dump += r.lrange(key, 0, -1)
        elif kind == b"zset":
            dump += r.zrange(key, 0, -1)
        dump.append(key)
    stored = b"\n".join(dump)
    assert b"calls:{r1}" in stored or r.xlen(prefix + "calls:{r1}") > 0
    logs = log.read_bytes()
    assert logs, "the gateway wrote no log at all"
    for secret in secrets:
        s = secret.encode()
        assert s not in stored, "a secret was written to Redis"
        assert s not in logs, "a secret was written to the gateway's log"
        assert secret not in metrics, "a secret appears in /metrics"
        assert not any(s in seen for seen in engine_saw), "a secret was forwarded to the engine"
    assert engine_saw  # the engine did get calls


def test_request_and_header_sizes_are_bounded(deployed):
    gw, _, r, prefix, _ = deployed
    url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
    n_calls = r.xlen(prefix + "calls:{r1}")
    pad = {"model": "m", "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    with httpx.Client(timeout=30) as c:
        resp = c.post(url, json=pad, headers=auth(ADMIN))
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        raw = httpx.Request("POST", url, json=pad).content
        resp = c.post(url, content=iter([raw[i:i + 512] for i in range(0, len(raw), 512)]),
                      headers={**auth(ADMIN), "content-type": "application/json"})  # chunked: no Content-Length
        assert resp.status_code == 413
        resp = c.post(f"{gw.url}/rollouts/r1/attempts/0/events", json={"type": "t", "data": {"x": "y" * MAX_BODY}},
                      headers=auth(ADMIN))
        assert resp.status_code == 413
        # headers: a few KB are fine; hundreds of KB get a 4xx (or the connection closed), never a crash
        ok = c.post(url, json=BODIES["chat/completions"], headers={**auth(ADMIN), "X-Pad": "p" * 16_000})
        assert ok.status_code == 200
        # the bound is the request head's 64 KiB (agl_gateway.server): just under passes, just over is a 431,
        # also as the second request of a kept-alive connection
        ok = c.post(url, json=BODIES["chat/completions"], headers={**auth(ADMIN), "X-Pad": "p" * 60_000})
        assert ok.status_code == 200
        try:
            big = c.post(url, json=BODIES["chat/completions"], headers={**auth(ADMIN), "X-Pad": "p" * 66_000})
            assert big.status_code == 431, big.status_code
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            pass  # closed while the client was still sending: also bounded
    for size in (300_000, 5_000_000):
        try:
            resp = httpx.post(url, json=BODIES["chat/completions"], headers={**auth(ADMIN), "X-Big": "b" * size},
                              timeout=30)
            assert 400 <= resp.status_code < 500, (size, resp.status_code)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            pass  # closed by the server mid-request: also fine
    # many small headers
    try:
        resp = httpx.post(url, json=BODIES["chat/completions"],
                          headers={**auth(ADMIN), **{f"X-H{i}": "v" * 60 for i in range(4000)}}, timeout=30)
        assert 400 <= resp.status_code < 500
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        pass
    # a raw request line far over the limit, then a half-sent header block the client abandons
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"GET /" + b"a" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert s.recv(100).startswith(b"HTTP/1.1 4")
        except ConnectionResetError:
            pass
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Half: " + b"h" * 1000)
    assert httpx.get(gw.url + "/healthz", timeout=10).status_code == 200
    assert r.xlen(prefix + "calls:{r1}") == n_calls + 2  # only the two accepted calls were recorded
