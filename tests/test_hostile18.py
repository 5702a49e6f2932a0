"""Round 18 of hostile input (docs/operations.md, "An eighteenth round"): each test failed before its fix."""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path

import httpx
import pytest
from agl_common.schemas import CallRecord, Rollout, RolloutStatus

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent


def _call(rid: str, prompt: list[int], response: list[int]) -> CallRecord:
    return CallRecord(rollout_id=rid, attempt_id="0", seq=0, route="chat", request={}, response={},
                      prompt_token_ids=prompt, response_token_ids=response, finish_reason="stop",
                      response_logprobs=[-0.5] * len(response))


def test_a_token_id_past_the_vocabulary_is_skipped_not_trained():
    """Left open by round 16: token ids were never compared with the trained model's vocabulary. An engine serving
    another model (a bigger vocabulary) gave ``ok`` records whose ids went into the rows, and the first update
    failed with an ``IndexError`` in the embedding, after minutes of rollouts. A call holding an id past the
    vocabulary is now skipped as ``token_id_outside_vocabulary`` (the rollout leaves the advantage statistics, as
    one without a usable call does), in the prompt or in the response."""
    from agl_trainer.algorithm.aggregate import AggregateStats, Vocabulary, build_rows
    from agl_trainer.algorithm.batch import build_batch
    from agl_trainer.config import TrainConfig

    vocab = Vocabulary(size=100)
    rollouts = [Rollout(rollout_id=f"r{i}", group_id="g", status=RolloutStatus.succeeded, reward=float(i % 2))
                for i in range(4)]
    calls = {"r0": [_call("r0", [1, 2], [3, 4])], "r1": [_call("r1", [1, 2], [3, 100])],
             "r2": [_call("r2", [1, 99], [5, 6])], "r3": [_call("r3", [1, 150_000], [5, 6])]}
    rows, adv, stats, _ = build_batch(rollouts, calls, TrainConfig(), vocab)
    assert [r.rollout_id for r in rows] == ["r0", "r2"] and len(adv) == 2
    assert stats.skipped_calls == {"token_id_outside_vocabulary": 2}
    assert max(max(r.prompt_ids + r.response_ids) for r in rows) < 100
    # without a known size nothing is bounded (ids are still in [0, 2**31): the gateway's check)
    assert len(build_rows(calls["r3"], stats=AggregateStats(), vocab=Vocabulary())) == 1


def test_the_vocabulary_size_is_the_models_embedding_else_the_tokenizers(tmp_path):
    """The bound is the number of ids the model embeds (``config.json``'s ``vocab_size``, often padded past the
    tokenizer), else the tokenizer's length for a tokenizer-only directory (``ui --tokenizer``)."""
    import shutil

    from agl_trainer.model import load_vocabulary
    from agl_trainer.ui.traces import load_decoder
    from transformers import AutoTokenizer

    tiny = ROOT / "packages" / "trainer" / "src" / "agl_trainer" / "assets" / "tiny-tokenizer"
    n = len(AutoTokenizer.from_pretrained(tiny))
    assert load_vocabulary(tiny).size == load_decoder(str(tiny)).size == n
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": n + 64}))
    assert load_vocabulary(model).size == n + 64
    (model / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"vocab_size": n + 8}}))
    assert load_vocabulary(model).size == n + 8
    from agl_trainer.model import embedded_ids

    tok = AutoTokenizer.from_pretrained(tiny)
    for odd in ({"vocab_size": True}, {"vocab_size": -3}, {"vocab_size": "big"}, {"text_config": "x"},
                {"text_config": [1]}, [1, 2]):  # (the fifth prober: true bounded every id to 0; a string text_config
        (model / "config.json").write_text(json.dumps(odd))  # was an AttributeError after the services started)
        assert embedded_ids(tok, model) == n, odd


@pytest.mark.timeout(300)
def test_the_run_loop_never_hands_an_update_an_id_past_the_vocabulary(tmp_path, redis_url, prefix):
    """The whole loop (real gateway, controller, harnesses; the shared fake engine, whose answers hold ids up to a
    few hundred) with a vocabulary of 8 ids: every call is skipped and counted in the step's metrics, no update is
    given a row (before: every row went to the update)."""
    from agl_trainer.algorithm.aggregate import Vocabulary
    from agl_trainer.config import TrainConfig
    from agl_trainer.loop import train_async
    from agl_trainer.services import Services
    from agl_trainer.stack import start_agents
    from rich.console import Console

    from fakes import Served, fake_upstream
    from test_loop import TASKS, RecordingBackend

    (tmp_path / "tasks.py").write_text(TASKS)
    cfg = TrainConfig(command=f"python {ROOT / 'tests' / 'harnesses' / 'eval_agent.py'}",
                      task_file=str(tmp_path / "tasks.py"), train_fn="train_problems", heldout_fn="heldout_problems",
                      steps=1, groups_per_step=2, group_size=2, eval_size=1, eval_subset=1, eval_every=0,
                      concurrency=8, rollout_timeout_s=60, preload=[], redis_url=redis_url, prefix=prefix,
                      out_dir=str(tmp_path / "runs"), loggers=["jsonl"])
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    with Served(fake_upstream()) as engine, Services(run_dir / "logs") as svc:
        start_agents(svc, cfg, engine.url, redis_url, cfg.model_name, run_dir / "logs" / "rollouts")
        backend = RecordingBackend(cfg.model_name)
        asyncio.run(train_async(cfg, run_dir, Console(file=io.StringIO()), redis_url, None, backend,
                                Vocabulary(size=8)))
    assert all(not rows for rows, _ in backend.updates)
    (step,) = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "eval" not in m and "step" in m]
    assert step["skipped_calls"] == {"token_id_outside_vocabulary": 4} and step["rows"] == 0


def test_yaml_booleans_are_true_and_false_only(tmp_path):
    """Left open by round 17: PyYAML reads YAML 1.1, where ``yes``/``no``/``on``/``off`` are booleans, so a key
    ``yes:`` was named ``True`` in the error and a role's model named ``no`` became ``False`` (refused as not a
    string). The config's YAML now has YAML 1.2's booleans; a boolean field still takes ``yes``."""
    import pydantic
    from agl_trainer.config import TrainConfig

    path = tmp_path / "c.yaml"
    path.write_text("yes: 3\n")
    with pytest.raises(pydantic.ValidationError, match=r"(?s)\byes\b.*Extra inputs"):
        TrainConfig.from_yaml(path)
    path.write_text("policy_serving: adapter\nroles:\n  solver: {models: [no]}\n  checker: {models: [off]}\n")
    cfg = TrainConfig.from_yaml(path)
    assert cfg.roles["solver"].models == ["no"] and cfg.roles["checker"].models == ["off"]
    path.write_text("steps: 2\nnorm_by_std: on\n")
    assert TrainConfig.from_yaml(path).norm_by_std is True
    path.write_text("steps: 2\nnorm_by_std: False\n")
    assert TrainConfig.from_yaml(path).norm_by_std is False


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]}),
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "3+4?"}], "stream": True,
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("messages", {"model": "m", "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_an_agent_that_leaves_a_call_that_is_not_a_live_stream_stops_its_generation(
        store, redis_url, prefix, upstream, route, body):
    """The gateway prober: an agent leaving a complete answer, a chat stream with tools or an Anthropic stream (all
    answered whole, then sent) kept the engine generating until its answer came, and a pause's drain waited for
    it (up to ``upstream_timeout_s``); Esc in a coding agent or an SDK timeout wasted a whole generation each
    time. The engine's call is now cancelled as soon as the agent goes away (as a live stream's is), the call is
    recorded ``abandoned`` at once and the drain does not wait for it."""
    import time

    from agl_common.control import pause_and_drain, resume

    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", json=body, timeout=60)
            assert r.status_code == 200  # (LiteLLM imported: the next call reaches the engine at once)
            with pytest.raises(httpx.TimeoutException):  # the engine takes 30 s; the agent gives up after 0.5 s
                await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", json={**body, "x_delay": 30},
                             timeout=0.5)
        t0 = time.monotonic()
        await pause_and_drain(store, pause_id="P", timeout_s=20)
        drained_s = time.monotonic() - t0
        await resume(store, release="P")
        ok, rec = await store.read_calls("r1")
    assert drained_s < 10 and ok.status == "ok", drained_s
    assert rec.status == "error" and rec.error.startswith("abandoned") and rec.latency_ms < 10_000, rec


def test_large_rewards_keep_their_groups_signal():
    """The controller prober: rewards were put into a float32 tensor before the "float64" advantage, so rewards
    ``[3e8, 3e8 + 1]`` (any reward within ±1e9 is accepted) gave advantages ``[0, 0]``: the step was skipped as
    without signal, while ``group_signal_frac`` (Python floats) counted the group as having one."""
    from agl_trainer.algorithm.batch import advantages_of

    def adv(base: float) -> list[float]:
        return advantages_of([Rollout(rollout_id=f"r{i}", group_id="g", status=RolloutStatus.succeeded,
                                      reward=base + i % 2) for i in range(4)], [1, 1, 1, 1]).tolist()

    small = adv(0.0)
    assert small[1] > 0.5 and small == pytest.approx([-small[1], small[1]] * 2)
    for base in (2e7, 3e8):
        assert adv(base) == pytest.approx(small, abs=1e-3), base


def test_mlflow_refuses_a_run_directory_its_sqlite_url_cannot_hold(tmp_path, monkeypatch):
    """The controller prober: ``out_dir`` went into ``sqlite:///{out_dir}/mlflow.db`` unquoted: ``exp?1`` wrote
    the database to ``exp`` (outside ``out_dir``; an existing file of that name was opened as the database),
    ``exp%41b`` retried for ~110 s and failed, after vLLM, the gateway and the controller had started. Such an
    ``out_dir`` is now refused in one line (exit 2) before anything starts."""
    import subprocess
    import sys

    from agl_trainer.trackers import check_trackers, mlflow_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("exp?1", "exp%41b"):
        with pytest.raises(ValueError, match="holds '\\?' or '%'"):
            check_trackers(["console", "mlflow"], tmp_path / name)
    assert mlflow_uri(tmp_path / "sp ace#") == f"sqlite:///{tmp_path / 'sp ace#' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert check_trackers(["mlflow"], tmp_path / "exp?1") == ["mlflow"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    config = tmp_path / "c.yaml"
    config.write_text(f"out_dir: '{tmp_path / 'exp?1'}'\nloggers: [console, mlflow]\n")
    r = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(config)], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in __import__("os").environ.items()
                                         if k != "MLFLOW_TRACKING_URI"})
    assert r.returncode == 2 and "holds '?' or '%'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "exp").exists()


def _resumable_run(tmp_path, state: dict, metrics: str | None, **overrides):
    from agl_trainer.config import TrainConfig

    from test_loop import TASKS

    (tmp_path / "tasks.py").write_text(TASKS)
    cfg = TrainConfig(task_file=str(tmp_path / "tasks.py"), train_fn="train_problems", heldout_fn="heldout_problems",
                      steps=3, groups_per_step=1, group_size=2, eval_size=3, eval_subset=2, preload=[],
                      out_dir=str(tmp_path / "runs"), loggers=["jsonl"], **overrides)
    run_dir = tmp_path / "runs" / "r1"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "weights.json").write_text(json.dumps({"updates": 2}))
    (run_dir / "checkpoint" / "state.json").write_text(json.dumps(state))
    (run_dir / "config.json").write_text(json.dumps(cfg.shown()))
    if metrics is not None:
        (run_dir / "metrics.jsonl").write_text(metrics)
    return cfg, run_dir


async def _resume(cfg, run_dir, redis_url):
    from agl_common.store import Store
    from agl_trainer.checkpoint import resume_state
    from agl_trainer.loop import TrainingRun
    from rich.console import Console
    from rich.progress import Progress

    from test_loop import RecordingBackend

    out = io.StringIO()
    store = Store(redis_url, cfg.prefix)
    run = TrainingRun(cfg, run_dir, Console(file=out, width=200), store, RecordingBackend(cfg.model_name), None,
                      Progress(disable=True))
    try:
        step = await asyncio.wait_for(run.resume(resume_state(run_dir)), 30)
    finally:
        await store.close()
    return run, step, out.getvalue()


@pytest.mark.parametrize("metrics", [
    json.dumps({"step": 1, "reward_mean": 0.5, "step_s": 3.0}) + "\n" + '{"step": 2, "rew',  # killed mid-append
    json.dumps({"step": 1, "step_s": 3.0}) + "\n\n[1, 2]\n" + json.dumps({"step": "2", "step_s": "x"}) + "\n",
])
async def test_a_resume_reads_a_metrics_file_a_kill_or_a_hand_left_damaged(tmp_path, redis_url, prefix, metrics):
    """The controller prober: the resume read ``metrics.jsonl`` with a bare ``json.loads`` per line, after vLLM,
    the gateway and the controller had started: a line cut by a kill mid-append, a blank line, a non-object or a
    step that is not a number was a traceback, and the run could not be resumed. Such lines are skipped (as the
    dashboard skips them), the step's line is written again on a line of its own, and the file stays readable."""
    from agl_trainer.checkpoint import logged_metrics

    state = {"step": 2, "version": 2, "metrics": {"step": 2, "groups": []}, "active": []}
    cfg, run_dir = _resumable_run(tmp_path, state, metrics, redis_url=redis_url, prefix=prefix)
    run, step, _ = await _resume(cfg, run_dir, redis_url)
    assert step == 3 and [m["step"] for m in run.metrics] == [1, 2] and run.train_s == 3.0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 2, "groups": []}
    assert [m["step"] for m in logged_metrics(run_dir) if "step" in m] == [1, 2]


def test_a_metrics_file_that_is_not_a_regular_file_refuses_the_resume_before_anything_starts(tmp_path):
    """The controller prober: a FIFO ``metrics.jsonl`` hung the resume for ever (after the services started)."""
    import os

    from agl_trainer.checkpoint import NotResumable
    from agl_trainer.run import check_resumable

    state = {"step": 2, "version": 2, "metrics": {"step": 2, "groups": []}, "active": []}
    cfg, run_dir = _resumable_run(tmp_path, state, None)
    os.mkfifo(run_dir / "metrics.jsonl")
    with pytest.raises(NotResumable, match="metrics.jsonl: not a regular file"):
        check_resumable(cfg, run_dir)


async def test_a_resume_on_a_redis_that_lost_the_run_drops_its_groups_and_reuses_no_id(tmp_path, redis_url,
                                                                                       prefix):
    """The controller prober: the run's own Redis (``--save ""``, started by the trainer when none answered) dies
    with a killed trainer, so ``train --resume`` meets an empty Redis. The checkpoint's groups in flight were a
    ``RolloutNotFound`` traceback after the services started, and the group counter began again at 0: new groups
    took the ids (``{run}-q1-g0``...) that earlier steps' metrics name, and the dashboard and ``export --run``
    showed the new rollouts under the old steps. The lost groups are now dropped (said on the console, their
    problems drawn again) and numbering goes on after the highest group the run used."""
    from agl_common.store import Store

    state = {"step": 2, "version": 2, "metrics": {"step": 2, "groups": ["r1-q3-g0"]},
             "active": [{"group_id": "r1-q4-g0", "rollout_ids": ["r1-q4-g0-r0", "r1-q4-g0-r1"], "version": 2}]}
    metrics = json.dumps({"step": 1, "groups": ["r1-q1-g0", "r1-q2-g0"]}) + "\n" + json.dumps(state["metrics"]) + "\n"
    cfg, run_dir = _resumable_run(tmp_path, state, metrics, redis_url=redis_url, prefix=prefix, active_groups=2)
    run, step, out = await _resume(cfg, run_dir, redis_url)
    assert step == 3 and run.scheduler.active == {}
    assert "1 group(s) in flight at the checkpoint are not in this Redis" in out
    store = Store(redis_url, prefix)
    try:
        assert await store.next_group_number("r1") == 5
        await store.skip_group_numbers("r1", 2)  # never lowered
        assert await store.next_group_number("r1") == 6
    finally:
        await store.close()


def test_eval_passes_over_runs_trained_with_other_weight_settings(tmp_path):
    """The controller prober: ``eval --policy v3`` (no roles) took the newest run's ``policy-v3`` under ``out_dir``
    without comparing its base model or LoRA rank/alpha with the config (the resume refuses exactly those): a
    mismatched policy was evaluated and reported as v3, or vLLM failed to load it after the services started. And
    "newest" was the name's order (``MMDD-...``: December before January). Such runs are passed over (named), with
    ``--run`` refused; the newest is the one whose ``config.json`` was written last."""
    import os

    from agl_trainer.config import TrainConfig
    from agl_trainer.evaluation import PolicyNotFound, resolve_policy

    cfg = TrainConfig(out_dir=str(tmp_path / "runs"), preload=[])

    def run(name: str, mtime: float, **settings):
        d = tmp_path / "runs" / name
        (d / "adapters" / "policy-v3").mkdir(parents=True)
        (d / "adapters" / "policy-v3" / "adapter_config.json").write_text("{}")
        (d / "config.json").write_text(json.dumps({**cfg.shown(), **settings}))
        os.utime(d / "config.json", (mtime, mtime))
        return d

    mine = run("1231-235900-aaaa", 1_000)
    other = run("0101-000100-bbbb", 2_000, lora_rank=64, lora_alpha=128)
    assert resolve_policy("v3", cfg).adapter == (mine / "adapters" / "policy-v3").resolve()
    with pytest.raises(PolicyNotFound, match="trained with other weight settings"):
        resolve_policy("v3", cfg, other)
    newer = run("0101-000200-cccc", 3_000)  # January, after December's: the newest
    assert resolve_policy("v3", cfg).adapter == (newer / "adapters" / "policy-v3").resolve()
    for d in (mine, newer):
        (d / "config.json").write_text(json.dumps({**cfg.shown(), "base_model": str(tmp_path)}))
    with pytest.raises(PolicyNotFound, match="trained with other weight settings: "):
        resolve_policy("v3", cfg)


async def test_a_stale_outcome_leaves_the_claim_of_the_attempt_now_running(store, redis_url, prefix, tmp_path):
    """The third prober: controller A, frozen past its lease, had its attempt 0 ended ``controller_lost`` by B, woke,
    and claimed the retry (attempt 1). When attempt 0's harness then exited, its stale outcome released the
    rollout's claim, which was attempt 1's, and dropped attempt 1's process from A's table: a clean stop of A
    neither signalled nor handed back attempt 1, and a crash left it ``running`` for ever, in nobody's processing
    list. A stale outcome now leaves the claim of the attempt the controller runs, and each attempt has its own
    process entry."""
    import sys

    from agl_common.store import Store
    from agl_controller.local import LocalRunner

    await store.create_rollout(Rollout(rollout_id="r", input={}))

    def runner(cid: str, command: list[str]) -> LocalRunner:
        return LocalRunner(Store(redis_url, prefix), "http://127.0.0.1:9", command, "m", controller_id=cid,
                           lease_ttl_s=1.0, max_attempts=3, log_dir=tmp_path / "logs")

    a = runner("ctlA", [sys.executable, "-c",
                        "import os, time; time.sleep(3 if os.environ['AGL_ATTEMPT_ID'] == '0' else 60)"])
    b = runner("ctlB", ["true"])
    try:
        await a.take_lease()
        assert await store.claim_queued("ctlA") == "r"
        first = asyncio.create_task(a.run_one("r"))  # attempt 0: its harness runs 3 s
        await asyncio.sleep(1.6)  # A is frozen: its 1 s lease lapses
        await b.take_lease()  # B adopts A's claim: attempt 0 ends controller_lost, attempt 1 is queued
        await store.renew_lease("ctlA", 1.0)  # A wakes and claims the retry
        assert await store.claim_queued("ctlA") == "r"
        second = asyncio.create_task(a.run_one("r"))
        await asyncio.sleep(0.5)
        assert (await store.get_rollout("r")).attempt_id == "1"
        assert await first is None  # attempt 0's outcome: stale
        assert await store.claimed("ctlA") == ["r"] and list(a._procs) == [("r", "1")]
        a._tasks.add(second)
        await a.shutdown()  # a clean stop hands attempt 1 back
        r = await store.get_rollout("r")
        assert (r.status.value, r.attempt_id) == ("queuing", "2") and await store.claimed("ctlA") == []
        assert await store.queued_ids() == ["r"]
    finally:
        for proc in list(a._procs.values()):
            with __import__("contextlib").suppress(ProcessLookupError):
                __import__("os").killpg(proc.pid, 9)
        a.close()
        b.close()
        await a.store.close()
        await b.store.close()


async def test_two_controllers_starting_under_one_id_at_once_one_is_refused(store, redis_url, prefix, tmp_path):
    """The third prober: ``take_lease`` read the lease, then set it: two controllers starting at once under one
    ``--controller-id`` (a fixed ``AGL_CONTROLLER_ID`` in two pods) both saw none and both ran, sharing one lease and
    one processing list; when the one running a rollout died, the other kept the lease alive and the dead one's
    rollouts stayed ``running`` (never adopted). The lease is now taken with an owner token in one step: one of
    them is refused (``ControllerIdLive``). A controller that finds its id taken while its lease lapsed stops and
    leaves the other's lease and claims alone."""
    from agl_common.store import Store
    from agl_controller.base import ControllerIdLive
    from agl_controller.local import LocalRunner

    def runner() -> LocalRunner:
        return LocalRunner(Store(redis_url, prefix), "http://127.0.0.1:9", ["true"], "m", controller_id="same",
                           lease_ttl_s=0.6, log_dir=tmp_path / "logs")

    async def no_lease(_controller_id):
        return None

    a, b = runner(), runner()
    try:
        for r in (a, b):  # both read "no lease" before either writes one (the race)
            r.store.lease_of = no_lease
        results = await asyncio.gather(a.take_lease(), b.take_lease(), return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["ControllerIdLive", "bool"], results
        # the winner is frozen past its lease; a new controller takes the id; the old one wakes and stops
        first = a if results[0] is True else b
        await asyncio.sleep(0.8)
        c = runner()
        assert await c.take_lease()
        stop, run_stop = asyncio.Event(), asyncio.Event()
        await asyncio.wait_for(first.lease_loop(stop, run_stop), 5)
        assert first.lease_lost.is_set() and run_stop.is_set()
        await first.store.drop_lease("same", owner=first._lease_owner)  # (its clean exit) leaves c's lease alone
        assert (await store.lease_of("same"))[0].startswith(c._lease_owner + " ")
        c.close()
        await c.store.close()
    finally:
        for r in (a, b):
            r.close()
            await r.store.close()


async def test_one_trainer_per_prefix(tmp_path, redis_url, prefix):
    """The third prober: a second ``train --resume DIR`` of a run that still lived (with ``gateway_url``, no check
    at start) took over every pending completion of the live trainer (``XAUTOCLAIM`` from idle 0) and adopted its
    groups: both trained the same group and both committed it; two runs on one prefix with ``gateway_url``
    published their policies over each other. A trainer now holds its prefix (a lease with an owner token, renewed
    from a thread of its own): a second one is refused at start (one line, exit 2, with or without
    ``gateway_url``) and, if it got past that check, before it touches anything; a killed trainer's lease lapses."""
    import time

    from agl_common.store import Store
    from agl_trainer.config import TrainConfig
    from agl_trainer.lease import TrainerLease, TrainerLive
    from agl_trainer.loop import train_async
    from agl_trainer.stack import PrefixInUse, check_prefix_free
    from rich.console import Console

    from test_loop import TASKS, RecordingBackend

    store = Store(redis_url, prefix)
    live = TrainerLease(redis_url, prefix, "run-a")
    live.renew_s = 0.2
    try:
        await asyncio.to_thread(live.take)
        assert await store.hold_trainer("someone-else", "run-b") == "run-a"
        cfg = TrainConfig(redis_url=redis_url, prefix=prefix, gateway_url="http://127.0.0.1:9")
        t0 = time.monotonic()
        with pytest.raises(PrefixInUse, match="run run-a is training on it"):
            await asyncio.to_thread(check_prefix_free, cfg)
        assert time.monotonic() - t0 < 5  # a live one is seen at once, not waited for
        (tmp_path / "tasks.py").write_text(TASKS)
        cfg = cfg.model_copy(update={"task_file": str(tmp_path / "tasks.py"), "train_fn": "train_problems",
                                     "heldout_fn": "heldout_problems", "preload": []})
        backend = RecordingBackend(cfg.model_name)
        with pytest.raises(TrainerLive, match="being trained by run run-a"):
            await train_async(cfg, tmp_path, Console(file=io.StringIO()), redis_url, None, backend)
        assert backend.served == [] and backend.updates == []
        await asyncio.sleep(0.5)
        await live.confirm()  # renewed all along: still run-a's
    finally:
        await asyncio.to_thread(live.let_go)
    assert await store.trainer_of() is None
    await asyncio.to_thread(check_prefix_free, cfg)  # free again
    # a killed trainer's lease (never let go) lapses: the next one waits for it, then starts
    assert await store.hold_trainer("killed", "run-a", ttl_s=1.0) is None
    t0 = time.monotonic()
    await asyncio.to_thread(check_prefix_free, cfg)
    assert 0.3 < time.monotonic() - t0 < 5
    await store.close()


async def test_a_trainer_that_lost_its_prefix_neither_pauses_publishes_nor_commits(tmp_path, redis_url, prefix):
    """The fifth prober: a trainer stalled past its lease while inside a step (Ctrl-Z, a VM pause) woke after
    another trainer had taken the prefix, and still paused that one's gateway, published its policy over it and
    committed (the lease was looked at only between steps). The lease is now confirmed (a fresh owned renewal)
    before the pause, before the publish and before the commit: the cycle stops there, its pause released."""
    from agl_common.store import Store
    from agl_trainer.cycle import backend_cycle
    from agl_trainer.lease import TrainerLease, TrainerLive

    from test_loop import RecordingBackend

    store = Store(redis_url, prefix)
    mine = TrainerLease(redis_url, prefix, "run-a")
    await asyncio.to_thread(mine.take)
    try:
        await store.r.delete(store.key("trainer"))  # run-a stalled past its lease...
        assert await store.hold_trainer("b-token", "run-b") is None  # ...and run-b took the prefix
        backend = RecordingBackend("m")
        with pytest.raises(TrainerLive, match="run run-b took prefix"):
            await backend_cycle(store, backend, 1, [], [], 5.0, mine.confirm)
        assert backend.updates == [] and backend.published == [] and await store.pauses() == {}
    finally:
        await asyncio.to_thread(mine.let_go)
    assert (await store.trainer_of())[0] == "run-b"  # left alone
    await store.close()


def test_an_endless_task_function_is_one_line_not_all_memory(tmp_path, monkeypatch):
    """The third prober: ``load_tasks`` took ``list(f())`` unbounded: a task function that is an endless generator
    grew until the OOM killer came (before anything started, but after minutes). It now stops at ``MAX_TASKS``
    items with one line (here with the bound lowered to 1000, to keep the test fast)."""
    from agl_trainer import tasks

    (tmp_path / "t.py").write_text("import itertools\ndef train_forever():\n"
                                   "    return ({'q': i} for i in itertools.count())\n"
                                   "def train_some():\n    return [{'q': i} for i in range(1000)]\n")
    monkeypatch.setattr(tasks, "MAX_TASKS", 1000)
    with pytest.raises(tasks.TaskError, match="gives more than 1,000 items"):
        tasks.load_tasks(tmp_path / "t.py", "train_forever")
    assert len(tasks.load_tasks(tmp_path / "t.py", "train_some")) == 1000


SPY = '''
import gc, json, os, sys
found = []
frame = sys._getframe()
while frame is not None:  # multiprocessing's preparation data of the forkserver this run was forked from
    found += [v["sys_argv"] for v in frame.f_locals.values() if isinstance(v, dict) and "sys_argv" in v]
    frame = frame.f_back
found += [o for o in gc.get_objects() if isinstance(o, list) and "--key" in o]
found.append(sys.argv)
with open(json.loads(os.environ["AGL_INPUT"])["out"], "w") as f:
    json.dump(found, f)
'''


async def test_a_preloaded_harness_finds_no_admin_key_in_its_memory(store, redis_url, prefix, tmp_path):
    """The fourth prober: a ``--preload`` harness walked its own Python frames to ``multiprocessing``'s preparation
    data, whose ``sys_argv`` is the controller's ``sys.argv``, and read ``--key`` there (``/proc`` was masked, Python's
    copy was not); with the key it set another rollout's reward. The CLIs now parse a copy of the command line and
    mask the secrets in ``sys.argv`` itself, so no multiprocessing child (the forkserver, a reward worker) gets them."""
    import subprocess
    import sys

    from agl_gateway.app import create_app
    from agl_gateway.settings import GatewaySettings

    from fakes import Served, fake_upstream

    key = "admin-k3y-not-for-harnesses-18"
    (tmp_path / "spy.py").write_text(SPY)
    out = tmp_path / "found.json"
    await store.create_rollout(Rollout(rollout_id="spy", input={"out": str(out)}))
    with Served(fake_upstream()) as up, Served(create_app(GatewaySettings(
            upstream=up.url, redis_url=redis_url, prefix=prefix, model="m", key=key))) as gw:
        proc = subprocess.Popen([sys.executable, "-m", "agl_controller", "run", "--command",
                                 f"{sys.executable} {tmp_path / 'spy.py'}", "--preload", "json", "--gateway", gw.url,
                                 "--prefix", prefix, "--key", key, "--log-dir", str(tmp_path / "logs")],
                                env={**os.environ, "AGL_REDIS_URL": redis_url}, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for _ in range(600):
                if out.exists() and (await store.get_rollout("spy")).status != RolloutStatus.running:
                    break
                await asyncio.sleep(0.1)
        finally:
            proc.terminate()
            log = proc.communicate(timeout=30)[0]
    found = out.read_text()
    assert "--key" in found and "***" in found and key not in found, (found[:500], log[-1500:])


def test_a_reward_worker_is_not_dumpable(monkeypatch):
    """The fourth prober: the reward function's worker (a ``spawn`` child: exec'd, so dumpable again) could have its
    memory read through ``/proc/<pid>/mem`` by a harness of the same user. It now makes itself non-dumpable, as the
    controller does (``/proc/<pid>/mem`` then belongs to root): the reward function reads its own flag."""
    from agl_controller.reward import RewardPool

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "harnesses"))
    pool = RewardPool("rewards:dumpable")
    try:
        assert asyncio.run(pool.score({}, "x", 30)) == 0.0
    finally:
        pool.close()


async def test_one_call_asks_for_a_bounded_number_of_choices(store, redis_url, prefix, upstream):  # noqa: F811
    """The fourth prober: ``n`` had no upper bound: one call with ``n: 100000`` (and a huge ``max_tokens``) was sent
    to the engine as it was, queueing that many generations past every cap (the caps count calls); 64 such calls
    starved every other rollout. ``n`` is now at most 16 (400 before the engine is asked); 16 is still forwarded."""
    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient(timeout=30) as c:
            url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
            msg = [{"role": "user", "content": "3+4?"}]
            for n in (17, 100_000):
                r = await c.post(url, json={"model": "m", "messages": msg, "n": n})
                assert r.status_code == 400 and "from 1 to 16" in r.text, r.text
            assert len(upstream.app.state.calls) == 0
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/completions", json={"model": "m", "prompt": "x",
                                                                                     "n": 17})
            assert r.status_code == 400 and len(upstream.app.state.calls) == 0
            r = await c.post(url, json={"model": "m", "messages": msg, "n": 16})  # (the stand-in answers 1 choice)
            assert r.status_code != 400 and upstream.app.state.calls[-1]["n"] == 16


async def test_a_controller_whose_id_was_taken_claims_nothing_more(store, redis_url, prefix, tmp_path):
    """The fifth prober: a controller frozen past its lease whose id another controller then took went on claiming
    (nothing checked the lease before ``claim_queued``) into that one's processing list, then handed the run back
    as a new attempt without queueing it: the rollout stayed ``queuing`` in no queue. It now renews its lease (with
    its token) before each claim and stops at once when the id is another's."""
    from agl_common.store import Store
    from agl_controller.local import LocalRunner

    a = LocalRunner(Store(redis_url, prefix), "http://127.0.0.1:9", ["sleep", "30"], "m", controller_id="c",
                    lease_ttl_s=30, log_dir=tmp_path / "logs")
    stop = asyncio.Event()
    task = asyncio.create_task(a.run_forever(stop))
    try:
        for _ in range(100):
            if await store.lease_of("c"):
                break
            await asyncio.sleep(0.05)
        await store.r.delete(store.key("controller", "c"))  # A's lease lapsed while it was frozen...
        assert await store.renew_lease("c", 30, owner="another-process")  # ...and another controller took the id
        await store.create_rollout(Rollout(rollout_id="x", input={}))
        await asyncio.wait_for(task, 10)  # A stops by itself
        assert a.lease_lost.is_set() and await store.queued_ids() == ["x"] and await store.claimed("c") == []
        assert (await store.get_rollout("x")).status.value == "queuing"
        assert (await store.lease_of("c"))[0].startswith("another-process ")  # left alone
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        a.close()
        await a.store.close()


def test_a_refused_trainer_touches_nothing_the_holder_uses(tmp_path, redis_url, prefix, monkeypatch):
    """The fifth prober: two trainers that both passed the check at start, on a shared engine (``engine_url``,
    ``policy_serving: merged``): the one refused by the lease had already loaded its weights into the engine the
    holder serves from, started its gateway and controller and written the run's ``config.json``, and on its way
    out loaded the base weights again. The lease is now taken before any of that; a refused trainer does none."""
    import agl_trainer.run as run_module
    import agl_trainer.services as services
    import agl_trainer.stack as stack
    from agl_common.store import Store
    from agl_trainer.config import TrainConfig
    from agl_trainer.lease import TrainerLive

    from test_loop import TASKS

    touched = []

    class NoServices:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def ensure_redis(self, url, harness_user=None):
            return url

    monkeypatch.setattr(services, "Services", NoServices)
    monkeypatch.setattr(stack, "start_engine", lambda *a, **k: touched.append("engine") or ("http://e", tmp_path))
    monkeypatch.setattr(stack, "start_agents", lambda *a, **k: touched.append("gateway and controller"))
    monkeypatch.setattr(run_module, "cpu_backend", lambda *a, **k: touched.append("backend"))
    async def hold():
        store = Store(redis_url, prefix)
        try:
            return await store.hold_trainer("holder", "run-a", ttl_s=60)
        finally:
            await store.close()

    assert asyncio.run(hold()) is None
    (tmp_path / "tasks.py").write_text(TASKS)
    cfg = TrainConfig(task_file=str(tmp_path / "tasks.py"), train_fn="train_problems", heldout_fn="heldout_problems",
                      out_dir=str(tmp_path / "runs"), redis_url=redis_url, prefix=prefix, preload=[],
                      engine_url="http://127.0.0.1:9", gateway_url="http://127.0.0.1:9", policy_serving="merged")
    with pytest.raises(TrainerLive, match="run-a"):
        run_module.run_training(cfg, resume_dir=None)
    assert touched == [] and not list((tmp_path / "runs").glob("*/config.json"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_held_by_a_pause_gives_its_slot_back_when_its_agent_leaves(store, redis_url, prefix, upstream,
                                                                               stream):
    """The fifth prober: 64 calls held by a pause whose agents gave up (SDK timeouts during a long update) kept
    their slots (and bodies) until the pause ended: the attempt's next call got 503 ``too_many_in_flight``. A held
    call now leaves the gate as soon as its agent goes away (a live stream's too), is neither forwarded nor
    recorded, and the attempt's next call is held as usual."""
    from agl_common.control import pause_and_drain, resume

    await make_rollout(store)
    body = {"model": "m", "messages": [{"role": "user", "content": "3+4?"}], "stream": stream}
    with gateway(redis_url, prefix, upstream.url, max_in_flight_per_attempt=4) as gw:
        url = f"{gw.url}/rollouts/r1/attempts/0/v1/chat/completions"
        await pause_and_drain(store, pause_id="P", timeout_s=10)
        async with httpx.AsyncClient() as c:
            for _ in range(6):  # more than the attempt's 4 slots: each leaves before the next comes
                with pytest.raises(httpx.TimeoutException):
                    await c.post(url, json=body, timeout=0.4)
                await asyncio.sleep(0.3)
            last = asyncio.create_task(c.post(url, json=body, timeout=30))
            await asyncio.sleep(0.5)
            assert not last.done()  # held, not refused
            await resume(store, release="P")
            r = await last
        assert r.status_code == 200, r.text
        assert len(upstream.app.state.calls) == 1 and len(await store.read_calls("r1")) == 1
