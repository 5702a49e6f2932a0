"""Round 16 of hostile input (docs/operations.md, "A sixteenth round"): each test failed before its fix."""

from __future__ import annotations

import asyncio
import json

import pytest
from agl_common.schemas import GroupInfo, Rollout, RolloutStatus
from agl_common.store import Store
from typer.testing import CliRunner

from agl_trainer.cli import app

RUN = "1206-000000-abcd"


async def _seed(redis_url: str, prefix: str) -> None:
    """Run RUN: a trained group and an evaluation group (owner None) named after the run; and a group of another
    run whose ids start with RUN (a hand-made id), which ``--run RUN`` counted before (it selected by id prefix)."""
    store = Store(redis_url, prefix)
    try:
        for gid, owner, run in ((f"{RUN}-q0-g0", RUN, RUN), (f"{RUN}-eval-before-ab12-g0", None, RUN),
                                (f"{RUN}-intruder-g0", "someone", "someone")):
            ids = [f"{gid}-{i}" for i in range(2)]
            await store.register_group(GroupInfo(group_id=gid, rollout_ids=ids, owner=owner, run=run))
            for rid in ids:
                await store.create_rollout(Rollout(rollout_id=rid, group_id=gid, status=RolloutStatus.succeeded,
                                                   reward=1.0), enqueue=False)
    finally:
        await store.close()


def test_a_run_is_its_registered_groups_not_an_id_prefix(redis_url, prefix):
    """Round 15 left open: ``rollouts list/export --run`` selected every rollout whose id started with the run id, so
    another run's rollout named ``{run}-...`` was listed and exported as this run's. Now a run is the groups
    registered with it (evaluations included)."""
    asyncio.run(_seed(redis_url, prefix))
    opts = ["--redis", redis_url, "--prefix", prefix]
    res = CliRunner().invoke(app, ["rollouts", "list", "--run", RUN, "--json", "--limit", "0", *opts])
    assert res.exit_code == 0, res.output
    listed = [json.loads(line)["rollout_id"] for line in res.stdout.splitlines()]
    assert listed == [f"{RUN}-q0-g0-0", f"{RUN}-q0-g0-1", f"{RUN}-eval-before-ab12-g0-0",
                      f"{RUN}-eval-before-ab12-g0-1"]  # creation order
    res = CliRunner().invoke(app, ["rollouts", "list", "--run", "someone", "--json", *opts])
    assert [json.loads(line)["rollout_id"] for line in res.stdout.splitlines()] == [f"{RUN}-intruder-g0-0",
                                                                                  f"{RUN}-intruder-g0-1"]
    res = CliRunner().invoke(app, ["rollouts", "export", "--run", RUN, "--rollout", f"{RUN}-intruder-g0-0", *opts])
    assert res.stdout == "" and "no rollout matched --rollout" in res.stderr  # not a member of RUN
    res = CliRunner().invoke(app, ["rollouts", "list", "--run", "no-such-run", "--json", *opts])
    assert res.exit_code == 0 and res.stdout == ""


async def test_a_group_is_registered_with_its_run_once(store):
    """The run's set is written by the script that registers the group: a group registered again (refused) adds
    nothing to a second run, and a group with no run is in none."""
    await store.register_group(GroupInfo(group_id="g1", rollout_ids=["g1-0"], run="r1"))
    with pytest.raises(ValueError, match="already exists"):
        await store.register_group(GroupInfo(group_id="g1", rollout_ids=["g1-0"], run="r2"))
    await store.register_group(GroupInfo(group_id="g2", rollout_ids=["g2-0"]))
    for rid, gid in (("g1-0", "g1"), ("g2-0", "g2")):
        await store.create_rollout(Rollout(rollout_id=rid, group_id=gid), enqueue=False)
    assert (await store.run_rollout_ids("r1"), await store.run_rollout_ids("r2")) == (["g1-0"], [])
    with pytest.raises(ValueError, match="run id may hold only"):
        GroupInfo(group_id="g3", rollout_ids=[], run="a}b")  # a run id is part of a key: a rollout id's rules


def test_eval_starts_its_controller_with_preload(monkeypatch, tmp_path):
    """Round 15 left open: nothing checked that ``agl-trainer eval`` starts its controller with the config's
    ``preload`` (train does, through the shared ``start_agents``)."""
    from agl_trainer import stack
    from agl_trainer.config import TrainConfig
    from agl_trainer.evaluation import EvalPolicy, run_eval
    from agl_trainer.services import Services

    seen = {}

    class Started(Exception):
        pass

    def start_controller(self, *args, **kwargs):
        seen["preload"] = args[9] if len(args) > 9 else kwargs.get("preload")
        raise Started

    monkeypatch.setattr(Services, "ensure_redis", lambda self, url: url or "redis://127.0.0.1:6379/0")
    monkeypatch.setattr(Services, "start_gateway", lambda self, *a, **k: "http://127.0.0.1:9")
    monkeypatch.setattr(Services, "start_controller", start_controller)
    monkeypatch.setattr(stack, "start_engine", lambda *a, **k: ("http://127.0.0.1:9/v1", None))
    cfg = TrainConfig(preload=["agents", "json"], out_dir=str(tmp_path), eval_size=1)
    with pytest.raises(Started):
        run_eval(cfg, EvalPolicy("base", 0))
    assert seen["preload"] == ["agents", "json"]
