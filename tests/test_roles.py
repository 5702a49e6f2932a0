"""A policy per sub-agent (roles): routing in the gateway and its error cases, the record's role."""

from __future__ import annotations

import httpx
import pytest
from agl_common.control import pause_and_drain, resume
from agl_common.schemas import (ControlCommand, Policy, Rollout, RolloutStatus, UnknownRole, policy_name,
                                policy_version, route_call)

from fakes import Served, fake_upstream
from test_gateway import gateway

ROLES = Policy(model="base", version=0, roles={"solver": "base", "checker": "base"},
               role_models={"solver-model": "solver", "checker-model": "checker"})


def ask(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "what is 3+4?"}]}


def test_route_call_by_model_name_and_header():
    assert route_call(ROLES, "solver-model") == ("solver", "base")
    assert route_call(ROLES, "whatever", "checker") == ("checker", "base")
    assert route_call(ROLES, "checker-model", "checker") == ("checker", "base")
    # without roles, every call goes to the one policy whatever it asked for
    assert route_call(Policy(model="p"), "anything", "solver") == (None, "p")
    with pytest.raises(UnknownRole, match=r"names no role.*known roles: checker \(model 'checker-model'\), "
                                          r"solver \(model 'solver-model'\)"):
        route_call(ROLES, "gpt-4o-mini")
    with pytest.raises(UnknownRole, match="unknown role 'planner'"):
        route_call(ROLES, "solver-model", "planner")
    with pytest.raises(UnknownRole, match="X-AGL-Role says 'checker' but model 'solver-model' is role 'solver'"):
        route_call(ROLES, "solver-model", "checker")
    with pytest.raises(UnknownRole, match="names no role"):
        route_call(ROLES, None)


def test_policy_roles_must_fit_together_and_names_are_versioned():
    with pytest.raises(ValueError, match="not in roles"):
        Policy(model="b", roles={"solver": "b"}, role_models={"m": "checker"})
    with pytest.raises(ValueError, match="role name"):
        Policy(model="b", roles={"a/b": "b"})
    assert policy_name(3, "solver") == "policy-v3-solver" and policy_version("policy-v3-solver") == 3
    assert policy_name(3) == "policy-v3" and policy_version("policy-v3") == 3
    assert policy_version("policy-v3-a/b") is None
    with pytest.raises(ValueError):
        policy_name(1, "../x")
    # a resume command carries the roles; the policy it makes is validated
    cmd = ControlCommand(cmd="resume", id="1", model="b", version=2, roles={"s": "policy-v2-s"},
                         role_models={"m": "s"})
    assert cmd.policy() == Policy(model="b", version=2, roles={"s": "policy-v2-s"}, role_models={"m": "s"})
    assert ControlCommand(cmd="pause", id="1").policy() is None


async def test_gateway_routes_each_role_to_its_adapter_and_records_it(store, redis_url, prefix):
    app = fake_upstream()
    await store.create_rollout(Rollout(rollout_id="r1", status=RolloutStatus.running), enqueue=False)
    with Served(app) as up, gateway(redis_url, prefix, up.url) as gw:
        await resume(store, policy=ROLES)
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        async with httpx.AsyncClient() as c:
            for _ in range(50):  # the replica applies the resume
                models = (await c.get(f"{gw.url}/rollouts/r1/attempts/0/v1/models")).json()
                if len(models["data"]) > 1:
                    break
            assert [m["id"] for m in models["data"]] == ["agent-model", "checker-model", "solver-model"]
            assert (await c.post(url, json=ask("solver-model"))).status_code == 200
            assert (await c.post(url, json=ask("x"), headers={"X-AGL-Role": "checker"})).status_code == 200
            # the trainer publishes a new adapter for the solver only; one version for the step
            pause = "p1"
            await pause_and_drain(store, pause, timeout_s=10)
            await resume(store, policy=ROLES.model_copy(update={"version": 1, "roles": {
                "solver": policy_name(1, "solver"), "checker": "base"}}), release=pause)
            assert (await c.post(url, json=ask("solver-model"))).status_code == 200
            assert (await c.post(url, json=ask("checker-model"))).status_code == 200
            # error cases: a 400 naming the known roles, nothing forwarded, nothing recorded
            sent = len(app.state.calls)
            bad = [await c.post(url, json=ask("gpt-4o-mini")),
                   await c.post(url, json=ask("solver-model"), headers={"X-AGL-Role": "planner"}),
                   await c.post(url, json=ask("solver-model"), headers={"X-AGL-Role": "checker"}),
                   await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/messages",
                                json={"model": "claude", "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "hi"}]})]
    for r in bad:
        assert r.status_code == 400, r.text
        assert "known roles: checker (model 'checker-model'), solver (model 'solver-model')" in r.text
    assert bad[0].json()["error"]["code"] == "unknown_role"
    assert len(app.state.calls) == sent
    calls = await store.read_calls("r1")
    assert [(c.role, c.model, c.model_version) for c in calls] == [
        ("solver", "base", 0), ("checker", "base", 0), ("solver", "policy-v1-solver", 1), ("checker", "base", 1)]
    assert [c["model"] for c in app.state.calls] == ["base", "base", "policy-v1-solver", "base"]
    # the stored policy (what a replica started later converges on) carries the roles
    assert (await store.get_policy()).roles == {"solver": "policy-v1-solver", "checker": "base"}


async def test_without_roles_calls_record_no_role(store, redis_url, prefix):
    app = fake_upstream()
    await store.create_rollout(Rollout(rollout_id="r1", status=RolloutStatus.running), enqueue=False)
    with Served(app) as up, gateway(redis_url, prefix, up.url) as gw:
        r = httpx.post(f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions", json=ask("any"),
                       headers={"X-AGL-Role": "solver"})
    assert r.status_code == 200
    (call,) = await store.read_calls("r1")
    assert call.role is None and call.model == "agent-model"
