"""Hostile input, round 2 (docs/operations.md "Hostile input"): numbers that are numbers but poison a run, ids and
text that reach a terminal, options that start a useless service, events that fill Redis."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import pytest
import torch
from agl_common.schemas import (EVENTS_PER_ATTEMPT_MAX, GroupInfo, Rollout, RolloutStatus, check_reward)

from fakes import Served, fake_upstream
from test_gateway import gateway


def test_one_far_off_logprob_gives_a_finite_gradient():
    """vLLM writes -9999 for a -inf logprob: exp(logp - old) overflowed float32 and the gradient was NaN."""
    from agl_trainer.algorithm.loss import ppo_loss

    for adv in (-1.0, 0.0, 1.0):
        lp = torch.tensor([[-0.5, -0.7]], requires_grad=True)
        loss, st = ppo_loss(lp, torch.tensor([[-9999.0, -0.7]]), torch.tensor([adv]), torch.tensor([[0.5, 0.5]]))
        loss.backward()
        assert math.isfinite(float(loss.detach())) and torch.isfinite(lp.grad).all() and math.isfinite(st["ratio_mean"])


def test_large_rewards_give_finite_advantages():
    """Rewards were cast to float32: a group's sum overflowed and every advantage was NaN."""
    from agl_trainer.algorithm.advantage import rollout_advantages

    groups = torch.tensor([0, 0, 0, 0])
    for rewards in ([3e38, 3e38, 0.0, 0.0], [1e9, 1e9, -1e9, -1e9]):
        for estimator, norm in (("grpo", True), ("grpo", False), ("rloo", True)):
            adv = rollout_advantages(torch.tensor(rewards, dtype=torch.float64), groups, estimator, norm)
            assert torch.isfinite(adv).all(), (rewards, estimator, norm, adv)
    for bad in (float("nan"), float("inf"), 1e10, -1e10, True, "1"):
        with pytest.raises(ValueError):
            check_reward(bad)
    assert check_reward(-1e9) == -1e9


def test_a_nonfinite_gradient_is_not_stepped(base_model, tmp_path):
    """A NaN gradient went through clip_grad_norm_ into optimizer.step(): the adapter was NaN for good."""
    from agl_trainer.algorithm.aggregate import Row
    from agl_trainer.backends.cpu import CpuBackend

    backend = CpuBackend(base_model, tmp_path, bf16=False, ppo_mini_batch_rollouts=None)
    row = Row("r", [1, 2, 3], [4, 5], [1, 1])
    row.old_logprobs = backend.logprobs([row])[0]  # on-policy: the ratio is 1, within the log-ratio clamp
    before = {k: v.detach().clone() for k, v in backend.model.named_parameters() if v.requires_grad}
    stats = backend.update([row], [float("nan")])
    assert stats["nonfinite_steps"] == 1
    after = dict(backend.model.named_parameters())
    assert all(torch.equal(after[k].detach(), v) for k, v in before.items())
    stats = backend.update([row], [1.0])
    assert stats["nonfinite_steps"] == 0 and all(torch.isfinite(p).all() for p in backend.model.parameters())


def test_group_ids_are_ids_and_cli_tables_drive_no_terminal(store, redis_url, prefix):
    """A --group of '[/]' made every `rollouts list` crash (Rich markup); ESC and OSC sequences in a group or a
    failure reached the terminal."""
    for bad in ("[/]", "a b", "x\x1b]0;pwned\x07", ""):
        with pytest.raises(ValueError, match="group id"):
            Rollout(rollout_id="r", group_id=bad)
        with pytest.raises(ValueError, match="group id"):
            GroupInfo(group_id=bad, rollout_ids=["r"])
    env = {"AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix, "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    cli = [sys.executable, "-m", "agl_trainer", "rollouts"]
    bad = subprocess.run(cli + ["create", "--input", "{}", "--id", "g1", "--group", "[/]"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid --group" in bad.stderr and "Traceback" not in bad.stderr


async def test_rollouts_list_escapes_what_it_prints(store, redis_url, prefix):
    await store.create_rollout(Rollout(rollout_id="f1", status=RolloutStatus.failed,
                                       failure="\x1b]0;pwned\x07[bold red]X[/] [link=http://evil]c[/link]"),
                               enqueue=False)
    env = {"AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix, "PATH": "/usr/bin:/bin", "COLUMNS": "300"}
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "list"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "\\x1b]0;pwned\\x07[bold red]X[/]" in out.stdout and "[link=http://evil]" in out.stdout


def test_options_that_would_start_a_useless_service_are_usage_errors(redis_url):
    """`--prefix 'a{b'` was a 54-line traceback (gateway) or 71 lines (controller); `--max-body-bytes 0` started a
    gateway that refused every call; `gateway pause --timeout nan` never timed out."""
    cases = [[sys.executable, "-m", "agl_gateway", "serve", "--prefix", "a{b"],
             [sys.executable, "-m", "agl_gateway", "serve", "--max-body-bytes", "0"],
             [sys.executable, "-m", "agl_gateway", "serve", "--max-hold", "-5"],
             [sys.executable, "-m", "agl_controller", "run", "--command", "true", "--prefix", "a{b"],
             [sys.executable, "-m", "agl_trainer", "gateway", "pause", "--timeout", "nan"],
             [sys.executable, "-m", "agl_trainer", "gateway", "pause", "--timeout", "-1"],
             [sys.executable, "-m", "agl_trainer", "rollouts", "export", "--min-reward", "nan"]]
    for argv in cases:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env={"AGL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"})
        assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 3, \
            (argv, out.returncode, out.stderr[-2000:])


def test_train_config_refuses_what_no_run_could_use():
    from agl_trainer.config import TrainConfig

    for data, says in (({"prefix": "a{b"}, "hash-tag"), ({"group_size": 10**8}, "group_size"),
                       ({"groups_per_step": 10**8}, "groups_per_step")):
        with pytest.raises(ValueError, match=says):
            TrainConfig.model_validate(data)


async def test_events_are_bounded_and_end_with_the_rollout(store, redis_url, prefix, monkeypatch):
    """Events were accepted after the rollout ended, of any size and in any number: 50 events of 1 MB from one
    scoped key left 99 MB in Redis."""
    import agl_gateway.routes.rollouts as routes

    monkeypatch.setattr(routes, "EVENTS_PER_ATTEMPT_MAX", 3)
    await store.create_rollout(Rollout(rollout_id="e1", status=RolloutStatus.running), enqueue=False)
    await store.create_rollout(Rollout(rollout_id="e2", status=RolloutStatus.succeeded), enqueue=False)
    with Served(fake_upstream()) as up, gateway(redis_url, prefix, up.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            url = f"{gw.url}/rollouts/e1/attempts/0/events"
            big = await c.post(url, json={"type": "t", "data": {"x": "y" * (64 * 1024)}})
            long_type = await c.post(url, json={"type": "t" * 200})
            ok = [await c.post(url, json={"type": "t", "data": {"i": i}}) for i in range(3)]
            full = await c.post(url, json={"type": "t"})
            done = await c.post(f"{gw.url}/rollouts/e2/attempts/0/events", json={"type": "t"})
            openapi = await c.get(f"{gw.url}/openapi.json")
    assert big.status_code == 400 and big.json()["error"]["code"] == "event_too_large"
    assert long_type.status_code == 400
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert full.status_code == 429 and full.json()["error"]["code"] == "too_many_events"
    assert done.status_code == 409 and done.json()["error"]["code"] == "rollout_finished"
    assert len(await store.read_events("e1")) == 3 and await store.read_events("e2") == []
    assert openapi.status_code == 200  # no key: the route list is public, as every route is
    assert EVENTS_PER_ATTEMPT_MAX == 1000


async def test_with_a_key_not_even_the_route_list_is_public(store, redis_url, prefix):
    with Served(fake_upstream()) as up, gateway(redis_url, prefix, up.url, key="s3cret") as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            assert (await c.get(f"{gw.url}/openapi.json")).status_code == 404


def test_metrics_with_nan_stay_json_and_the_run_page_keeps_updating(tmp_path):
    """A diverged run wrote NaN into metrics.jsonl and the dashboard's polled /api/runs/{run} answered 500."""
    from agl_trainer.trackers import JsonlTracker
    from agl_trainer.ui.runs import load_run

    run = tmp_path / "r1"
    run.mkdir()
    JsonlTracker(run).log_metrics({"step": 1, "loss": float("nan"), "x": [float("inf"), 1.0],
                                   "roles": {"a": {"loss": float("-inf")}}}, 1)
    line = (run / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 1, "loss": None, "x": [None, 1.0], "roles": {"a": {"loss": None}}}
    with (run / "metrics.jsonl").open("a") as f:  # what older runs wrote
        f.write('{"step": 2, "loss": NaN, "reward_mean": Infinity}\n')
    json.dumps(load_run(run).to_json(), allow_nan=False)  # what the page polls: valid JSON


# ---------------------------------------------------------------------------------------------- round 3
async def test_ids_outside_any_vocabulary_are_not_kept_and_the_export_holds(store, redis_url, prefix, tmp_path):
    """The record kept ids of 2**63+5 (recorded error): the Parquet export of the prefix crashed on them."""
    from fakes import chat_answer

    app = fake_upstream()
    await store.create_rollout(Rollout(rollout_id="x1", status=RolloutStatus.running), enqueue=False)
    with Served(app) as up, gateway(redis_url, prefix, up.url) as gw:
        app.state.plan = ("body", 200, json.dumps(chat_answer("up", [1, 2**63 + 5], [7, 2])).encode())
        r = httpx.post(f"{gw.url}/rollouts/x1/attempts/0/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    (rec,) = await store.read_calls("x1")
    assert rec.status == "error" and "out of range" in rec.error and rec.prompt_token_ids == []
    env = {"AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "rollouts", "export", "--format", "parquet", "--out",
                          str(tmp_path / "x.parquet")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


async def test_gateway_status_prints_names_escaped(store, redis_url, prefix):
    """A served model name '[/]' (from an engine's /v1/models or an operator) crashed `gateway status`; an OSC-8
    link in it reached the terminal. (Round 6: a policy cannot hold a name with control characters at all; a
    replica's heartbeat still may, and is printed escaped.)"""
    from agl_common.control import resume
    from agl_common.schemas import ReplicaStatus

    with pytest.raises(ValueError, match="printable"):
        await resume(store, model="[/]\x1b]8;;http://evil\x1b\\click", version=1)
    await resume(store, model="[/]", version=1)
    await store.heartbeat(ReplicaStatus(replica_id="gw1", model="m\x1b]8;;http://evil\x1b\\click"))
    env = {"AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix, "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "gateway", "status"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "\x1b" not in out.stdout and "[/]" in out.stdout and "m\\x1b]8;;http://evil" in out.stdout, out.stdout


def test_a_policy_that_cannot_route_is_refused_when_made_and_when_read():
    """An empty served name went to the engine as model "" (recorded as the base model); a resume with model ""
    was published and silently changed nothing; a control message with bad roles made a replica reconnect."""
    from agl_common.schemas import ControlCommand, Policy

    for bad in (dict(model=""), dict(model="b", roles={"s": ""}), dict(model="b", roles={"s": "b"},
                                                                          role_models={"": "s"})):
        with pytest.raises(ValueError):
            Policy(**bad)
    with pytest.raises(ValueError, match="roles travel only with a resume"):
        ControlCommand(cmd="resume", id="1", roles={"s": "b"})
    with pytest.raises(ValueError):  # what a replica reads off the channel: refused at parse, so ignored there
        ControlCommand.model_validate_json(
            '{"cmd": "resume", "id": "1", "model": "b", "roles": {"s": "b"}, "role_models": {"m": "nobody"}}')


async def test_two_role_headers_that_disagree_are_refused(store, redis_url, prefix):
    from agl_common.control import resume
    from agl_common.schemas import Policy

    await store.create_rollout(Rollout(rollout_id="h1", status=RolloutStatus.running), enqueue=False)
    policy = Policy(model="b", roles={"solver": "b", "checker": "b"}, role_models={"s": "solver"})
    with Served(fake_upstream()) as up, gateway(redis_url, prefix, up.url) as gw:
        await resume(store, policy=policy)
        url = f"{gw.url}/rollouts/h1/attempts/0/v1/chat/completions"
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(timeout=60) as c:
            for _ in range(50):  # the replica applies the resume
                if (await c.post(url, json=body)).status_code == 400:
                    break
            two = await c.post(url, json=body, headers=[("X-AGL-Role", "solver"), ("X-AGL-Role", "checker")])
            same = await c.post(url, json=body, headers=[("X-AGL-Role", "checker"), ("X-AGL-Role", "checker")])
    assert two.status_code == 400 and "sent 2 times with different values" in two.text
    assert same.status_code == 200


async def test_concurrent_events_cannot_pass_the_cap(store, redis_url, prefix, monkeypatch):
    """The count was read, then the event added: 60 concurrent posts at 990 events left 1008."""
    import asyncio

    import agl_gateway.routes.rollouts as routes

    monkeypatch.setattr(routes, "EVENTS_PER_ATTEMPT_MAX", 5)
    await store.create_rollout(Rollout(rollout_id="c1", status=RolloutStatus.running), enqueue=False)
    with Served(fake_upstream()) as up, gateway(redis_url, prefix, up.url) as gw:
        async with httpx.AsyncClient(timeout=60) as c:
            got = await asyncio.gather(*(c.post(f"{gw.url}/rollouts/c1/attempts/0/events", json={"type": "t"})
                                         for _ in range(30)))
    assert sorted(r.status_code for r in got) == [200] * 5 + [429] * 25
    assert len(await store.read_events("c1")) == 5


def test_ui_with_a_bad_prefix_is_one_line(redis_url):
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "ui", "--prefix", "a{b", "--tokenizer", "none"],
                         capture_output=True, text=True, timeout=60, env={"AGL_REDIS_URL": redis_url,
                                                                         "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and "invalid --redis / --prefix" in out.stderr


def test_roles_that_no_run_could_use_and_a_resume_with_other_roles(tmp_path):
    from agl_trainer.config import TrainConfig
    from agl_trainer.run import NotResumable, check_resumable

    base = {"policy_serving": "adapter"}
    for roles, says in (({f"r{i}": {} for i in range(17)}, "at most 16"),
                        ({"Solver": {}, "solver": {}}, "differ only in case"),
                        ({"a": {"models": [" s"]}}, "without surrounding spaces"),
                        ({"a": {"models": ["s" * 300]}}, "1 to 256")):
        with pytest.raises(ValueError, match=says):
            TrainConfig.model_validate({**base, "roles": roles})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"roles": {"solver": {}, "checker": {}}}))
    check_resumable(TrainConfig.model_validate({**base, "roles": {"checker": {}, "solver": {}}}), run)
    with pytest.raises(NotResumable, match="trained with roles"):
        check_resumable(TrainConfig(), run)
    with pytest.raises(NotResumable):
        check_resumable(TrainConfig.model_validate({**base, "roles": {"solver": {}}}), run)


# ---------------------------------------------------------------------------------------------- round 4
def test_an_attempt_id_is_a_short_decimal(redis_url, prefix):
    """`--open` took an attempt id of 4400 digits; reading its calls then failed (Python's int() limit) for
    `rollouts show`, the whole prefix's export and the dashboard page."""
    from agl_common.schemas import check_attempt_id

    with pytest.raises(ValueError, match="1 to 9 digits"):
        Rollout(rollout_id="r", attempt_id="1" + "0" * 4400)
    for ok in ("0", "1", "123456789"):
        assert check_attempt_id(ok) == ok
    for bad in ("01", "1234567890", "²", "-1", ""):
        with pytest.raises(ValueError):
            check_attempt_id(bad)
    with Served(fake_upstream()) as up, gateway(redis_url, prefix, up.url, open=True) as gw:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        long_path = httpx.post(f"{gw.url}/rollouts/big/attempts/1{'0' * 4400}/v1/chat/completions", json=body)
        long_header = httpx.post(f"{gw.url}/v1/chat/completions", json=body,
                                 headers={"X-AGL-Rollout-Id": "big", "X-AGL-Attempt-Id": "1" + "0" * 20})
    assert long_path.status_code == 400 and long_path.json()["error"]["code"] == "invalid_attempt"
    assert long_header.status_code == 400 and long_header.json()["error"]["code"] == "invalid_attempt"
