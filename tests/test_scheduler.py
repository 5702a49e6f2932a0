"""Synchronous and collocated-async group scheduling, staleness and train-once, on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import torch
from agl_common.schemas import RolloutStatus
from agl_trainer.algorithm.loss import ppo_loss, truncated_is_weights
from agl_trainer.scheduler import Group, GroupScheduler

INPUTS = [{"question": f"q{i}", "answer": i} for i in range(10)]


async def finish(store, group: Group, rewards=(1.0, 0.0)) -> None:
    for rid, reward in zip(group.rollout_ids, rewards):
        await store.set_status(rid, RolloutStatus.running)

        def change(r, reward=reward):
            r.reward = reward
        await store.update_rollout(rid, change)
        await store.set_status(rid, RolloutStatus.succeeded)


async def test_sync_waits_for_the_whole_batch(store):
    sched = GroupScheduler(store, INPUTS, group_size=2, train_groups=2, tag="sync")
    await sched.top_up(0)
    g1, g2 = sched.active.values()
    await finish(store, g1)
    with pytest.raises(TimeoutError):
        await sched.next_batch(0, timeout_s=0.6)
    await finish(store, g2)
    batch = await sched.next_batch(0, timeout_s=5)
    assert [g.group_id for g in batch.groups] == [g1.group_id, g2.group_id]
    assert batch.carried_over == 0 and batch.stale_dropped == 0 and batch.ages == [0, 0]
    assert all(len(g.rollouts) == 2 for g in batch.groups)


async def test_async_trains_first_complete_groups_and_carries_the_rest(store):
    sched = GroupScheduler(store, INPUTS, group_size=2, train_groups=2, active_groups=4, tag="async")
    await sched.top_up(0)
    groups = list(sched.active.values())
    assert len(groups) == 4
    await finish(store, groups[3])
    await asyncio.sleep(0.6)  # seen complete before the next one
    batch_task = asyncio.create_task(sched.next_batch(0, timeout_s=10))
    await asyncio.sleep(0.8)
    await finish(store, groups[1])
    batch = await batch_task
    assert [g.group_id for g in batch.groups] == [groups[3].group_id, groups[1].group_id]
    assert batch.carried_over == 2
    # the next step tops up to 4 in flight again; carried-over groups keep their creation version
    await finish(store, groups[0])
    await finish(store, groups[2])
    batch2 = await sched.next_batch(1, timeout_s=5)
    assert {g.group_id for g in batch2.groups} == {groups[0].group_id, groups[2].group_id}
    assert batch2.ages == [1, 1] and len(sched.active) == 2


async def test_stale_groups_are_dropped_and_groups_train_once(store):
    sched = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, active_groups=2, max_staleness=1, tag="st")
    await sched.top_up(0)
    old, other = sched.active.values()
    await finish(store, old)
    task = asyncio.create_task(sched.next_batch(2, timeout_s=10))  # two versions later: `old` is stale
    await asyncio.sleep(0.8)
    assert not task.done()
    fresh = [g for g in sched.active.values() if g.version == 2][0]
    await finish(store, fresh)
    batch = await task
    assert batch.stale_dropped == 1 and [g.group_id for g in batch.groups] == [fresh.group_id]
    await sched.commit(batch.groups)
    # a restarted trainer adopting an already trained group skips it
    again = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, tag="st", consumer="other")
    assert await again.adopt(Group(fresh.group_id, fresh.rollout_ids, 2)) == "trained"
    assert fresh.group_id not in again.active


async def pending(store, sched) -> int:
    return (await store.r.xpending(store.key("completed"), sched.consumer_group))["pending"]


async def test_a_trainer_killed_mid_step_loses_no_group_and_trains_none_twice(store):
    """Trainer A takes a batch and dies before committing it; trainer B (same run, new process) takes
    A's pending completions over and trains exactly those groups; a third start finds nothing to redo."""
    a = GroupScheduler(store, INPUTS, group_size=2, train_groups=2, active_groups=3, tag="run1", consumer="A")
    await a.top_up(0)
    g1, g2, g3 = a.active.values()
    await finish(store, g1)
    await finish(store, g2)
    batch = await a.next_batch(0, timeout_s=5)
    assert {g.group_id for g in batch.groups} == {g1.group_id, g2.group_id}
    assert await pending(store, a) == 4  # delivered to A, not acknowledged: A "dies" here
    # B restarts from A's previous checkpoint, which knew only g3 in flight (g1, g2 were created after it)
    b = GroupScheduler(store, INPUTS, group_size=2, train_groups=2, active_groups=3, tag="run1", consumer="B")
    await b.adopt(Group(g3.group_id, g3.rollout_ids, 0))
    assert await b.start() == 4
    assert {g1.group_id, g2.group_id} <= set(b.active)  # adopted from their completion entries
    batch = await b.next_batch(0, timeout_s=5)
    assert sorted(g.group_id for g in batch.groups) == sorted([g1.group_id, g2.group_id])
    assert all(len(g.rollouts) == 2 for g in batch.groups)
    # group numbers continue after A's: no rollout id is reused
    assert all(int(gid.split("-q")[1].split("-")[0]) >= 3 for gid in b.active if gid != g3.group_id)
    await b.commit(batch.groups)
    assert await pending(store, b) == 0
    assert sorted(m.decode() for m in await store.r.smembers(store.key("trained"))) == sorted(
        [g1.group_id, g2.group_id])
    # C (a restart after B's commit): nothing pending, g1/g2 never handed out again
    await finish(store, g3)
    c = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, active_groups=1, tag="run1", consumer="C")
    for g in (g1, g2, g3):
        await c.adopt(Group(g.group_id, g.rollout_ids, 0))
    assert await c.start() == 0
    batch = await c.next_batch(0, timeout_s=5)
    assert [g.group_id for g in batch.groups] == [g3.group_id]  # complete from its status alone


async def test_killed_after_the_checkpoint_before_the_commit(store):
    """The checkpoint (commit point) lists the step's groups: re-marking them trained acknowledges their
    pending entries at the next start instead of training them again."""
    a = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, tag="run2", consumer="A")
    await a.top_up(0)
    (g1,) = a.active.values()
    await finish(store, g1)
    batch = await a.next_batch(0, timeout_s=5)
    assert [g.group_id for g in batch.groups] == [g1.group_id]
    b = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, tag="run2", consumer="B")
    await store.commit_trained(b.consumer_group, [g1.group_id], [])  # what run.py does with state["trained"]
    assert await b.start() == 2
    assert g1.group_id not in b.active and await pending(store, b) == 0


async def test_other_runs_and_evaluations_are_acknowledged_not_trained(store):
    from agl_trainer.scheduler import create_rollouts

    sched = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, tag="mine", consumer="A")
    await sched.start()
    ids = await create_rollouts(store, INPUTS[:1], 2, "mine-eval-before", 0)
    ids += await create_rollouts(store, INPUTS[:1], 2, "someone-q0", 0)
    for rid in ids:
        await store.set_status(rid, RolloutStatus.running)
        await store.set_status(rid, RolloutStatus.failed, "x")
    with pytest.raises(TimeoutError):
        await sched.next_batch(0, timeout_s=1.2)
    assert all(not gid.startswith(("mine-eval", "someone")) for gid in sched.active)
    assert await pending(store, sched) == 0


def test_truncated_importance_weights_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.9]]))
    w = truncated_is_weights(old, behaviour, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5 / 0.9])  # 5.0 truncated to 2
    loss, _ = ppo_loss(old, old, torch.tensor([1.0]), torch.full((1, 3), 1 / 3), is_weights=w)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 0.5 / 0.9) / 3)


async def test_group_membership_and_owner_come_from_the_registry_not_from_ids(store):
    """A group whose id looks like ours but that another run owns is acknowledged, not adopted; a group we own is
    adopted with the members and version it was registered with (here 3 rollouts, though this scheduler makes 2)."""
    from agl_common.schemas import GroupInfo
    from agl_trainer.scheduler import create_rollouts

    await create_rollouts(store, INPUTS[:1], 2, "reg-q90", 0, owner="someone-else")  # id in our pattern
    await create_rollouts(store, INPUTS[:1], 3, "reg-q91", 4, owner="reg")  # ours, created by a dead trainer
    with pytest.raises(ValueError, match="already exists"):
        await store.register_group(GroupInfo(group_id="reg-q91-g0", rollout_ids=["x"], owner="reg"))
    sched = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, active_groups=1, tag="reg", consumer="A")
    await sched.start()
    for gid, n in (("reg-q90-g0", 2), ("reg-q91-g0", 3)):
        await finish(store, Group(gid, [f"{gid}-{i}" for i in range(n)], 0), rewards=(1.0, 0.0, 1.0))
    batch = await sched.next_batch(4, timeout_s=10)
    (g,) = batch.groups
    assert g.group_id == "reg-q91-g0" and g.version == 4 and len(g.rollouts) == 3
    assert "reg-q90-g0" not in sched.active
    assert (await store.groups(["reg-q90-g0", "nope"]))[1] is None
