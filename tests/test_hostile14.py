"""Hostile input, round 14 (docs/operations.md "Hostile input"): what round 13 left open."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from test_export import RUN, export, jsonl, recorded  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_export_of_one_rollout_keeps_the_other_filters_and_says_when_nothing_matched(recorded):  # noqa: F811
    """Round 13 left open: ``--rollout ID --run OTHER`` exported the rollout anyway (``--run`` was ignored with
    ``--rollout``), and a filter that matched nothing was an empty JSONL with exit 0 and not a word."""
    one = f"{RUN}-g0-1"
    assert {c["rollout_id"] for c in jsonl(export(recorded, "--rollout", one, "--run", RUN))} == {one}
    res = export(recorded, "--rollout", one, "--run", "other-run")
    assert jsonl(res) == [] and f"no rollout matched --rollout '{one}', --run 'other-run'" in res.stderr
    res = export(recorded, "--run", RUN, "--status", "queuing")
    assert jsonl(res) == [] and "no rollout matched --run" in res.stderr and "--status 'queuing'" in res.stderr
    res = export(recorded, "--run", RUN)
    assert "no rollout matched" not in res.stderr


def test_an_export_that_matches_nothing_never_empties_a_file(recorded, tmp_path):  # noqa: F811
    """The round's prober: ``--out old.jsonl`` with a filter that matched nothing emptied the file (exit 0), where
    Parquet refused (exit 1) without the "no rollout matched" line; ``--run ''`` matched every rollout silently; a long
    ``--run`` was echoed whole."""
    for fmt in ("jsonl", "parquet"):
        old = tmp_path / f"old.{fmt}"
        old.write_text("keep")
        res = export(recorded, "--run", "nothing-", "--format", fmt, "--out", str(old))
        assert res.exit_code == 1 and old.read_text() == "keep", (fmt, res.output)
        assert "no rollout matched --run 'nothing-'" in res.stderr and "no file written" in res.stderr
    for bad in ("", "x" * 3000):  # a run id follows a rollout id's rules (round 16: --run is no id prefix now)
        res = export(recorded, "--run", bad)
        assert res.exit_code == 2 and "run id must be 1 to" in res.output and res.stdout == ""
        assert "x" * 100 not in res.output


def test_the_controller_refuses_the_other_modes_options(redis_url, prefix, tmp_path):
    """Round 13 left open: ``--mode local --template job.j2 --namespace ns`` ran harnesses here as if the k8s
    options applied, and ``--mode k8s --preload m`` dropped the preload without a word. Now an option of the other
    mode on the command line is a usage error (exit 2, before anything starts); from the environment (a deployment's
    shared variables) a warning line."""
    from typer.testing import CliRunner

    from agl_controller.cli import app
    from test_controller_k8s import TEMPLATE

    tpl = tmp_path / "job.j2"
    tpl.write_text(TEMPLATE)
    base = ["run", "--redis", redis_url, "--prefix", prefix, "--gateway", "http://127.0.0.1:9"]
    for args, flag in ((["--command", "true", "--template", str(tpl)], "--template"),
                       (["--command", "true", "--namespace", "ns"], "--namespace"),
                       (["--command", "true", "--jobs-per-minute", "5"], "--jobs-per-minute"),
                       (["--mode", "k8s", "--template", str(tpl), "--preload", "json"], "--preload"),
                       (["--mode", "k8s", "--template", str(tpl), "--command", "python a.py"], "--command"),
                       (["--mode", "k8s", "--template", str(tpl), "--log-dir", str(tmp_path)], "--log-dir")):
        res = CliRunner().invoke(app, base + args)
        assert res.exit_code == 2 and f"{flag} is a" in res.output and "would ignore it" in res.output, (args,
                                                                                                          res.output)
    res = CliRunner().invoke(app, base + ["--mode", "k8s", "--template", str(tpl), "--dry-run", "--input", '{"task": "a"}'],
                             env={"AGL_PRELOAD": "json", "AGL_LOG_DIR": str(tmp_path)})
    assert res.exit_code == 0, res.output
    assert "AGL_PRELOAD (--preload) is a local-mode option: ignored in k8s mode" in res.stderr
    assert "AGL_LOG_DIR (--log-dir)" in res.stderr and "kind: Job" in res.stdout and "warning" not in res.stdout


async def _cancel_as_it_wakes(loop_body, event: asyncio.Event, rounds: int = 40) -> int:
    """Start ``loop_body`` ``rounds`` times; each time set ``event`` and cancel the task in the same instant
    (after 0-3 loop iterations); how many tasks were still running 0.5 s later (the cancellation lost)."""
    stuck = 0
    for i in range(rounds):
        event.clear()
        task = asyncio.create_task(loop_body())
        for _ in range(i % 4):
            await asyncio.sleep(0)
        event.set()
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
        if not task.done():
            stuck += 1
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
    return stuck


async def test_a_cancellation_that_meets_a_wake_up_is_never_lost():
    """``asyncio.wait_for`` (Python 3.11) lost a ``cancel()`` that came as the event it waited for was set: the
    gateway's heartbeat loop, woken by a gate change as its shutdown cancelled it, went on heartbeating for ever. The
    gateway never finished shutting down, its replica id stayed claimed, and the next gateway under that id did not
    start (a CI failure: "server did not start"). Every timed wait now goes through ``agl_common.aio``."""
    from agl_common.aio import wait_until, within

    event = asyncio.Event()

    async def waits():
        while True:
            await wait_until(event, 5)

    async def waits_within():
        while True:
            with contextlib.suppress(TimeoutError):
                await within(event.wait(), 5)

    assert await _cancel_as_it_wakes(waits, event) == 0
    assert await _cancel_as_it_wakes(waits_within, event) == 0
    assert await wait_until(event, 0) is True and await wait_until(asyncio.Event(), 0.01) is False
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)


async def test_the_gateways_heartbeat_loop_ends_when_cancelled_as_it_is_woken(monkeypatch):
    import agl_gateway.app as gw_app

    async def heartbeat(st):  # a heartbeat that succeeds at once (the loop, not Redis, is under test)
        await asyncio.sleep(0)

    monkeypatch.setattr(gw_app, "_heartbeat", heartbeat)
    st = type("St", (), {"settings": type("S", (), {"heartbeat_s": 5.0})})()
    wake = asyncio.Event()
    assert await _cancel_as_it_wakes(lambda: gw_app._heartbeat_loop(st, wake), wake) == 0


def test_no_package_waits_with_asyncio_wait_for():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "packages").glob("*/src/**/*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if "wait_for(" in line]
    assert found == []


@pytest.mark.parametrize("where", ["one Redis", pytest.param("cluster", marks=pytest.mark.redis_cluster)])
async def test_a_store_call_never_hides_a_cancellation(where, request, redis_url, prefix):
    """redis-py (8.1) returned normally from most commands during which their task was cancelled (145 of 200 in a
    loop of ``SET``): a loop around Store calls never ended. The gateway's heartbeat loop, cancelled by its shutdown
    mid-heartbeat, went on for ever, so the gateway never stopped and kept its replica id: the next gateway under
    that id did not start (the thirteenth round's CI failure). Commands, scripts, pipelines and pub/sub."""
    from agl_common.schemas import ReplicaStatus
    from agl_common.store import Store

    url = redis_url if where == "one Redis" else request.getfixturevalue("redis_cluster").url
    store = Store(url, prefix)

    async def commands():
        while True:
            await store.heartbeat(ReplicaStatus(replica_id="x"), "owner")  # a script
            await store.replicas()  # a pipeline, then a command

    async def listens():  # as the gateway's control loop: subscribe, listen, close, again
        while True:
            pubsub = await store.subscribe_control()
            try:
                async for _ in pubsub.listen():
                    pass
            finally:
                await pubsub.aclose()

    lost = 0
    for loop in (commands, listens):
        for i in range(50):
            task = asyncio.create_task(loop())
            await asyncio.sleep(0.0005 * (i % 10))
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
            if not task.done():
                lost += 1
                while not task.done():
                    task.cancel()
                    await asyncio.sleep(0.01)
    assert lost == 0
    async with asyncio.timeout(5):  # a timeout around a Store call is still a TimeoutError, not a cancellation
        assert await store.replicas(include_late=True)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            while True:
                await store.replicas()
    await store.drop_replica("x")
    await store.close()
