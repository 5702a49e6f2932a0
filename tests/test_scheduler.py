"""Synchronous and collocated-async group scheduling, staleness and train-once, on a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import torch
from agl_common.schemas import RolloutStatus
from agl_trainer.loss import ppo_loss, truncated_is_weights
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
    # a restarted trainer adopting an already trained group skips it
    again = GroupScheduler(store, INPUTS, group_size=2, train_groups=1, tag="st2")
    await again.adopt(Group(fresh.group_id, fresh.rollout_ids, 2))
    again.active_groups = 1
    batch = await again.next_batch(2, timeout_s=5)
    assert batch.groups == []


def test_truncated_importance_weights_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.9]]))
    w = truncated_is_weights(old, behaviour, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5 / 0.9])  # 5.0 truncated to 2
    loss, _ = ppo_loss(old, old, torch.tensor([1.0]), torch.full((1, 3), 1 / 3), is_weights=w)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 0.5 / 0.9) / 3)
