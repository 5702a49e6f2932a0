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
        async with httpx.AsyncClient(timeout=60) as c:
            for _ in range(50):  # the replica applies the resume
                models = (await c.get(f"{gw.url}/rollouts/r1/attempts/0/v1/models")).json()
                if models["data"][0]["id"] != "agent-model":
                    break
            assert [m["id"] for m in models["data"]] == ["checker-model", "solver-model"]  # what a call may ask for
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


# ---------------------------------------------------------------------------------------------- trainer side
def call(seq, prompt, response, role, rid="r1"):
    from agl_common.schemas import CallRecord

    return CallRecord(rollout_id=rid, attempt_id="0", seq=seq, route="chat", request={}, response={},
                      prompt_token_ids=prompt, response_token_ids=response, response_logprobs=[-0.5] * len(response),
                      finish_reason="length", role=role)


def test_rows_never_mix_roles():
    from agl_trainer.algorithm.aggregate import AggregateStats, build_rows

    stats = AggregateStats()
    # the checker's prompt extends the solver's row exactly: without roles it would merge
    calls = [call(0, [1, 2], [3, 4], "solver"), call(1, [1, 2, 3, 4, 5], [6], "checker"),
             call(2, [1, 2, 3, 4, 5, 6, 7], [8], "checker")]
    rows = build_rows(calls, stats=stats)
    assert [(r.role, r.seqs) for r in rows] == [("solver", [0]), ("checker", [1, 2])]
    assert stats.merge_break_classes == {"role_change": 1}
    plain = build_rows([c.model_copy(update={"role": None}) for c in calls])
    assert [(r.role, r.seqs) for r in plain] == [(None, [0, 1, 2])]


def test_role_signals_per_role():
    from agl_trainer.algorithm.aggregate import Row
    from agl_trainer.algorithm.stepstats import role_signals

    done = RolloutStatus.succeeded  # (a rollout's outcome reward is a succeeded one's: evalstats.outcome_reward)
    rollouts = [Rollout(rollout_id="a", reward=1.0, status=done), Rollout(rollout_id="b", reward=0.0, status=done),
                Rollout(rollout_id="c", status=done)]
    calls = {"a": [call(0, [1], [2], "solver", "a"), call(1, [1], [2], "checker", "a")],
             "b": [call(0, [1], [2], "solver", "b").model_copy(update={"finish_reason": "stop"})],
             "c": [call(0, [1], [2], "solver", "c")]}
    rows = [Row("a", [1], role="solver"), Row("a", [1], role="checker"), Row("b", [1], role="solver")]
    assert role_signals(rollouts, calls, rows) == {
        "checker": {"calls": 1, "truncation_rate": 1.0, "rollouts": 1, "reward_mean": 1.0, "rows": 1},
        "solver": {"calls": 3, "truncation_rate": 2 / 3, "rollouts": 3, "reward_mean": 0.5, "rows": 2}}
    assert role_signals(rollouts, {"a": [call(0, [1], [2], None, "a")]}, []) == {}


def test_roles_config_errors_are_clear():
    from agl_trainer.config import TrainConfig

    ok = TrainConfig.from_yaml("examples/arithmetic/roles.yaml")
    assert ok.base_policy().role_models == {"solver": "solver", "checker": "checker"}
    cases = [({"roles": {"a": {"models": ["m"]}, "b": {"models": ["m"]}}, "policy_serving": "adapter"},
              "model name 'm' is given to two roles"),
             ({"roles": {"a": {"models": ["m"]}}}, "roles need policy_serving: adapter"),
             ({"roles": {"a": {}}, "policy_serving": "adapter", "backend": "verl"}, "cpu backend only"),
             ({"roles": {"a/b": {}}, "policy_serving": "adapter"}, "role name"),
             ({"roles": {"a": {"models": [" "]}}, "policy_serving": "adapter"}, "1 to 256 printable"),
             ({"roles": {"a": {"modles": ["m"]}}, "policy_serving": "adapter"}, "modles"),
             ({"roles": {"a": {"lora_rank": 0}}, "policy_serving": "adapter"}, "lora_rank")]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            TrainConfig.model_validate(data)


class FakeRoleBackend:
    """One role's backend (the shape of CpuBackend with ``role=``): remembers what it was asked."""

    def __init__(self, out_dir, role):
        self.out_dir, self.role, self.log, self.updates = out_dir, role, [], 0

    def update(self, rows, advantages):
        self.log.append(("update", [r.rollout_id for r in rows], list(advantages)))
        self.updates += 1
        return {"loss": 1.0 if self.role == "solver" else 4.0, "grad_norm": 1.0, "clip_frac": 0.0, "ratio_mean": 1.0,
                "ratio_first": 1.0, "clip_frac_first": 0.0, "entropy": 2.0, "kl": 0.0, "train_tokens": 10,
                "updates": 1, "dropped_rollouts": 0, "dropped_rows": 0, "update_s": 0.5}

    async def publish(self, version):
        path = self.out_dir / policy_name(version, self.role)  # what CpuBackend.save writes
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text("{}")
        self.log.append(("publish", version))
        return Policy(model=policy_name(version, self.role), version=version)

    async def serve(self, version):
        self.log.append(("serve", version))
        return Policy(model=policy_name(version, self.role), version=version)

    async def retire(self, version):
        self.log.append(("retire", version))

    def checkpoint(self, path):
        path.mkdir(parents=True)
        (path / "updates").write_text(str(self.updates))

    def restore(self, path):
        self.updates = int((path / "updates").read_text())


async def test_roles_backend_trains_publishes_and_resumes_each_role(tmp_path):
    from agl_trainer.algorithm.aggregate import Row
    from agl_trainer.backends.roles import RolesBackend

    def make():
        return RolesBackend({r: FakeRoleBackend(tmp_path, r) for r in ("solver", "checker")}, ROLES)

    b = make()
    rows = [Row("a", [1], role="solver"), Row("a", [1], role="checker"), Row("b", [1], role="solver"),
            Row("c", [1], role=None)]
    # step 1: both roles have rows; each gets its own rows with the rollout's advantage
    st = b.update(rows, [0.5, 0.5, -0.5, 1.0])
    s, c = b.backends["solver"], b.backends["checker"]
    assert s.log == [("update", ["a", "b"], [0.5, -0.5])] and c.log == [("update", ["a"], [0.5])]
    assert st["roles_skipped"] == [] and st["rows_without_role"] == 1 and st["update_rows"] == 3
    assert st["loss"] == pytest.approx((1.0 * 2 + 4.0 * 1) / 3) and st["train_tokens"] == 20 and st["updates"] == 2
    assert st["roles"]["checker"]["rows"] == 1 and st["roles"]["solver"]["loss"] == 1.0
    p1 = await b.publish(1)
    assert p1.version == 1 and p1.roles == {"solver": "policy-v1-solver", "checker": "policy-v1-checker"}
    assert p1.role_models == ROLES.role_models
    await b.retire(0)
    # step 2: only the solver has rows: the checker is skipped, counted, not published anew, still served
    st = b.update([Row("d", [1], role="solver")], [1.0])
    assert st["roles_skipped"] == ["checker"] and list(st["roles"]) == ["solver"]
    p2 = await b.publish(2)
    assert p2.roles == {"solver": "policy-v2-solver", "checker": "policy-v1-checker"}
    await b.retire(1)
    assert ("retire", 1) in s.log and not any(e[0] == "retire" for e in c.log)
    assert [e for e in c.log if e[0] == "publish"] == [("publish", 1)]
    b.checkpoint(tmp_path / "ckpt")
    # a restarted trainer: every role's weights and optimizer back, each serving its newest adapter
    again = make()
    again.restore(tmp_path / "ckpt")
    assert again.backends["solver"].updates == 2 and again.backends["checker"].updates == 1
    served = await again.serve(2)
    assert served == p2
    assert again.backends["solver"].log == [("serve", 2)] and again.backends["checker"].log == [("serve", 1)]
    assert (await make().serve(0)).roles == {"solver": "base", "checker": "base"}
    with pytest.raises(ValueError, match="roles"):
        RolesBackend({"solver": s}, ROLES)


def test_the_dashboard_draws_per_role_curves_and_the_step_line_names_roles(tmp_path):
    import json

    from agl_trainer.loop import step_line
    from agl_trainer.ui.runs import load_run

    steps = [{"step": 1, "reward_mean": 0.2, "roles": {"solver": {"reward_mean": 0.2, "loss": 0.5, "rows": 8},
                                                       "checker": {"reward_mean": 0.3, "rows": 0}}},
             {"step": 2, "reward_mean": 0.4, "roles": {"solver": {"reward_mean": 0.4, "loss": 0.25, "rows": 8},
                                                       "checker": {"reward_mean": 0.5, "loss": 1.0, "rows": 2}}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    charts = {c["title"]: c for c in load_run(tmp_path).series()}
    loss = charts["loss per role"]["series"]
    assert [(s["label"], s["values"]) for s in loss] == [("checker", [None, 1.0]), ("solver", [0.5, 0.25])]
    assert charts["reward per role (rollouts that called it)"]["series"][0]["values"] == [0.3, 0.5]
    line = step_line({**steps[0], "group_signal_frac": 0.5, "truncation_rate": 0.1, "response_tokens_mean": 20,
                      "skipped_update": "no rows", "step_s": 1, "time_generation_s": 1, "time_harness_startup_s": 0,
                      "time_wait_s": 0}, 60)
    assert "solver: 8 rows, loss +0.500; checker: 0 rows, skipped" in line
