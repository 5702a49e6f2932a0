"""The Kubernetes runner: naming, rendering and validation with the official client's models, the dry run,
and the reconciler against a fake API server (tests/fake_k8s.py) over real HTTP, with real Redis."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import yaml
from agl_common.auth import scoped_key
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from agl_controller.cli import app
from agl_controller.k8s import JobRenderer, K8sRunner, RateLimit, job_name, label_value, validate_job
from kubernetes.client import ApiClient
from typer.testing import CliRunner

from fake_k8s import FakeK8s

TEMPLATE = """
apiVersion: batch/v1
kind: Job
metadata:
  name: ignored
  labels: {team: rl}
spec:
  template:
    spec:
      initContainers:
        - name: setup
          image: busybox
      containers:
        - name: agent
          image: {{ input.image | default('agent:latest') }}
          args: ["--task", {{ input.task | tojson }}]
          env:
            - {name: OPENAI_BASE_URL, value: "http://wrong"}
            - {name: KEEP, value: "yes"}
          resources:
            limits: {cpu: 1, memory: 1Gi}
"""
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def test_job_names_are_dns1123_idempotent_and_distinct():
    assert job_name("ok-1", "0") == "agl-ok-1-0" == job_name("ok-1", "0")
    names = [job_name(r, a) for r, a in [("My_Rollout/1", "0"), ("my-rollout-1", "0"), ("x" * 200, "12"),
                                         ("x" * 201, "12"), ("ÜÖ", "3"), ("--", "0")]]
    for n in names:
        assert len(n) <= 63 and DNS1123.match(n), n
    assert len(set(names)) == len(names)
    assert names[2].endswith("-12") and len(names[2]) == 63
    assert label_value("ok.1_a") == "ok.1_a" and len(label_value("a:" * 50)) <= 63


def test_render_injects_contract_env_labels_and_validates_with_the_client_models():
    r = JobRenderer(TEMPLATE, "http://gw:8080", "m", key="k3y", namespace="rl", ttl_after_finished_s=120,
                    timeout_s=30, prefix="exp:")
    rollout = Rollout(rollout_id="Run_7", attempt_id="2", input={"task": "2+2 'q'", "n": 3}, env_map={"N": "n"})
    m = r.render(rollout)
    job = ApiClient().deserialize(json.dumps(m), "V1Job", "application/json")  # the client's own model
    assert job.metadata.name == job_name("Run_7", "2") and job.metadata.namespace == "rl"
    assert job.metadata.annotations["agl.dev/rollout-id"] == "Run_7"
    for labels in (job.metadata.labels, job.spec.template.metadata.labels):
        assert labels["agl.dev/rollout"] == "Run_7" and labels["agl.dev/attempt"] == "2"
        assert labels["app.kubernetes.io/managed-by"] == "agl-controller"
    assert job.metadata.labels["team"] == "rl"
    assert (job.spec.backoff_limit, job.spec.ttl_seconds_after_finished, job.spec.active_deadline_seconds) == (0, 120, 30)
    assert job.spec.template.spec.restart_policy == "Never"
    base = "http://gw:8080/rollouts/Run_7/attempts/2"
    for c in job.spec.template.spec.containers + job.spec.template.spec.init_containers:
        env = {e.name: e.value for e in c.env}
        assert env["OPENAI_BASE_URL"] == base + "/v1" and env["ANTHROPIC_BASE_URL"] == base
        assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == scoped_key("k3y", "Run_7", "2")
        assert env["AGL_REWARD_URL"] == base + "/reward" and env["AGL_MODEL"] == "m" and env["N"] == "3"
        assert (env["AGL_ROLLOUT_ID"], env["AGL_ATTEMPT_ID"]) == ("Run_7", "2")
        assert json.loads(env["AGL_INPUT"]) == rollout.input
        assert [e.name for e in c.env].count("OPENAI_BASE_URL") == 1
    agent = job.spec.template.spec.containers[0]
    assert agent.args == ["--task", "2+2 'q'"] and agent.image == "agent:latest"
    assert agent.resources.limits == {"cpu": "1", "memory": "1Gi"}
    assert {e.name: e.value for e in agent.env}["KEEP"] == "yes"
    # a rollout can bring its own template, where the operator allows it (round 5: off by default)
    own = Rollout(rollout_id="o", input={"agl_job_template": "spec: {template: {spec: {containers: [{name: c}]}}}"})
    with pytest.raises(ValueError, match="does not take a rollout's own"):
        r.render(own)
    r.input_templates = True
    assert r.render(own)["spec"]["template"]["spec"]["containers"][0]["name"] == "c"


@pytest.mark.parametrize("template, error", [
    ("spec: {template: {spec: {containers: [{name: c, imag: x}]}}}", "unknown field.*containers\\[0\\].imag"),
    ("spec: {template: {spec: {containers: [{image: x}]}}}", "invalid Job manifest"),
    ("spec: {template: {spec: {containers: []}}}", "containers is empty"),
    ("spec: {{ input.missing }}", "cannot render"),
    ("- a list", "one YAML mapping"),
])
def test_render_rejects_bad_templates(template, error):
    with pytest.raises(ValueError, match=error):
        JobRenderer(template, "http://gw", "m").render(Rollout(rollout_id="r", input={}))
    with pytest.raises(ValueError):
        validate_job({"spec": {"backoffLimit": "many"}})


def test_dry_run_prints_valid_manifests_without_a_cluster(tmp_path):
    tpl = tmp_path / "job.yaml.j2"
    tpl.write_text(TEMPLATE)
    res = CliRunner().invoke(app, ["run", "--mode", "k8s", "--dry-run", "--template", str(tpl),
                                   "--gateway", "http://gw", "--input", '{"task": "a"}', "--input", '{"task": "b"}'])
    assert res.exit_code == 0, res.output
    docs = [d for d in yaml.safe_load_all(res.output) if d]
    assert [d["metadata"]["name"] for d in docs] == ["agl-dry-run-0-0", "agl-dry-run-1-0"]
    for d in docs:
        validate_job(d)


def test_rate_limit_is_per_sliding_minute():
    rl = RateLimit(2)
    assert rl.allow(0.0) and rl.allow(1.0) and not rl.allow(59.0)
    assert rl.allow(60.5) and not rl.allow(60.9)


@pytest.fixture
def fake():
    with FakeK8s() as f:
        yield f


def runner(store, fake, **kw) -> K8sRunner:
    kw.setdefault("watch", False)
    return K8sRunner(store, "http://gw", "spec: {template: {spec: {containers: [{name: a, image: x}]}}}", "m",
                     api_client=fake.api_client(), job_lost_after_s=60, **kw)


async def succeed_in_store(store, rid: str, aid: str) -> None:
    """What a well-behaved harness does through the gateway: one recorded call and a reward."""
    await store.record_call(CallRecord(rollout_id=rid, attempt_id=aid, seq=-1, route="chat", request={},
                                       response={"choices": [{"message": {"content": "7"}}]}))

    def reward(r: Rollout) -> None:
        r.reward = 1.0
    await store.update_rollout(rid, reward)


def term(**kw) -> dict:
    return {"containerStatuses": [{"name": "a", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
                                   "state": kw}]}


async def test_reconciler_maps_job_and_pod_outcomes(store, fake):
    k = runner(store, fake, jobs_per_minute=100)
    ids = ["ok", "oom", "pull", "evict", "deadline", "exit", "cancel", "bare"]
    for rid in ids:
        await store.create_rollout(Rollout(rollout_id=rid))
    assert await k.launch_some() == len(ids)
    assert fake.job_names() == sorted(f"agl-{r}-0" for r in ids)
    await k.reconcile_jobs()  # nothing finished yet
    assert all(r.status == RolloutStatus.running for r in await store.get_rollouts(ids))

    await succeed_in_store(store, "ok", "0")
    fake.set_condition("agl-ok-0", "Complete")
    fake.add_pod("agl-oom-0", term(terminated={"exitCode": 137, "reason": "OOMKilled"}))
    fake.set_condition("agl-oom-0", "Failed", "BackoffLimitExceeded")
    fake.add_pod("agl-pull-0", term(waiting={"reason": "ImagePullBackOff"}))  # still active
    fake.add_pod("agl-evict-0", {"phase": "Failed", "reason": "Evicted"})
    fake.set_condition("agl-evict-0", "Failed", "BackoffLimitExceeded")
    fake.set_condition("agl-deadline-0", "Failed", "DeadlineExceeded")
    fake.add_pod("agl-exit-0", term(terminated={"exitCode": 3, "reason": "Error"}))
    fake.set_condition("agl-exit-0", "Failed", "BackoffLimitExceeded")
    fake.set_condition("agl-bare-0", "Complete")  # ran, but made no model call

    def cancel(r: Rollout) -> None:
        r.status, r.failure = RolloutStatus.failed, "cancelled"
    await store.update_rollout("cancel", cancel)

    await k.reconcile_jobs()
    got = {r: (await store.get_rollout(r)) for r in ids}
    assert got["ok"].status == RolloutStatus.succeeded and got["ok"].reward == 1.0
    assert {r: got[r].failure for r in ids if r != "ok"} == {
        "oom": "oom_killed", "pull": "image_pull", "evict": "evicted", "deadline": "deadline_exceeded",
        "exit": "exit_code:3", "cancel": "cancelled", "bare": "no_model_calls"}
    assert all(got[r].status == RolloutStatus.failed for r in ids if r != "ok")
    names = fake.job_names()
    assert "agl-pull-0" not in names and "agl-cancel-0" not in names  # active Jobs deleted
    assert "agl-ok-0" in names and "agl-oom-0" in names  # finished Jobs are left to ttlSecondsAfterFinished
    assert await store.claimed(k.controller_id) == []


async def test_jobs_per_minute_and_concurrency_limits(store, fake):
    k = runner(store, fake, jobs_per_minute=2)
    for i in range(4):
        await store.create_rollout(Rollout(rollout_id=f"r{i}"))
    assert await k.launch_some() == 2 and await k.launch_some() == 0
    assert len(fake.job_names()) == 2
    k2 = runner(store, fake, concurrency=1, jobs_per_minute=100)
    assert await k2.launch_some() == 1 and await k2.launch_some() == 0
    assert len(fake.job_names()) == 3


async def test_watch_wakes_the_runner_and_retries_are_new_jobs(store, fake):
    k = runner(store, fake, watch=True, reconcile_every_s=30, poll_s=0.1, max_attempts=2)
    await store.create_rollout(Rollout(rollout_id="w"))
    stop = asyncio.Event()
    task = asyncio.create_task(k.run_forever(stop))
    try:
        async def until(cond, what):
            for _ in range(100):
                if await cond():
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(what)

        async def has(name):
            return name in fake.job_names()
        await until(lambda: has("agl-w-0"), "first Job")
        await asyncio.sleep(0.5)  # first reconcile done; from now on only the watch can wake the runner
        fake.add_pod("agl-w-0", term(terminated={"exitCode": 137, "reason": "OOMKilled"}))
        fake.set_condition("agl-w-0", "Failed", "BackoffLimitExceeded")
        await until(lambda: has("agl-w-1"), "retry Job (woken by the watch)")
        r = await store.get_rollout("w")
        assert (r.status, r.attempt_id) == (RolloutStatus.running, "1")
        env = {e["name"]: e["value"] for e in fake.job("agl-w-1")["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["AGL_ATTEMPT_ID"] == "1"
        await succeed_in_store(store, "w", "1")
        fake.set_condition("agl-w-1", "Complete")

        async def done():
            return (await store.get_rollout("w")).status == RolloutStatus.succeeded
        await until(done, "success")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    events = await store.read_events("w")
    assert [(e["attempt_id"], e["type"], e["data"]) for e in events] == [("0", "attempt_failed",
                                                                         {"failure": "oom_killed"})]


async def test_new_controller_adopts_jobs_of_a_dead_one(store, fake):
    a = runner(store, fake, controller_id="A")
    for rid in ("x", "y", "q"):
        await store.create_rollout(Rollout(rollout_id=rid))
    a.lease_ttl_s = 0.2
    await store.renew_lease("A", 0.2, owner=a._lease_owner)  # (its own lease: launch_some renews it first)
    a.concurrency = 2
    assert await a.launch_some() == 2  # x and y run; q stays queued
    # a crash between "running" and the Job's creation: claimed, running, no Job
    await store.create_rollout(Rollout(rollout_id="lost"), enqueue=False)
    await store.enqueue("lost")
    assert await store.claim_queued("A", None) == "q"
    assert await store.claim_queued("A", None) == "lost"
    await store.set_status("lost", RolloutStatus.running)
    await asyncio.sleep(0.3)  # A's lease expires

    b = runner(store, fake, controller_id="B")
    b.job_lost_after_s = 0
    assert await b.reconcile_claims() == 4
    assert sorted(await store.claimed("B")) == ["lost", "x", "y"]
    assert (await store.get_rollout("x")).status == RolloutStatus.running  # still running: not failed
    assert await store.pop_queued() == "q"  # back in the queue
    await b.launch(await _requeue_and_claim(store, "q", "B"))
    assert "agl-q-0" in fake.job_names()
    await succeed_in_store(store, "x", "0")
    fake.set_condition("agl-x-0", "Complete")
    await b.reconcile_jobs()
    assert (await store.get_rollout("x")).status == RolloutStatus.succeeded
    assert (await store.get_rollout("y")).status == RolloutStatus.running
    lost = await store.get_rollout("lost")
    assert (lost.status, lost.failure) == (RolloutStatus.failed, "job_lost")
    # creating the same attempt's Job twice is harmless (idempotent name, 409 AlreadyExists)
    res = await b.launch(await _claim_running_again(store, "y", "B"))
    assert res is not None and res.status == RolloutStatus.running and fake.job_names().count("agl-y-0") == 1


async def _requeue_and_claim(store, rid: str, cid: str) -> str:
    await store.enqueue(rid)
    return await store.claim_queued(cid, None)


async def _claim_running_again(store, rid: str, cid: str) -> str:
    """Simulate a controller that crashed after creating the Job but before recording it: re-run launch."""
    def back(r: Rollout) -> None:
        r.status = RolloutStatus.queuing
    await store.update_rollout(rid, back)
    return await _requeue_and_claim(store, rid, cid)
