"""Which groups are in flight and which are trained next: synchronous and collocated-async RL.

Synchronous (``active_groups == train_groups``): start a batch of groups, wait for all, train.
Collocated async (``active_groups > train_groups``): keep up to ``active_groups`` groups running; train
on the first ``train_groups`` groups to complete; carry the rest over to the next step (their agents
keep running, held by the gateway during the update, and continue on the new policy). A group created
more than ``max_staleness`` policy versions ago is dropped when it completes (counted), never trained.
Heavy-tailed rollout durations make this ~2x faster end to end (bench/async_sim.py).

Every group is trained at most once: the trainer claims it with ``SADD {prefix}trained`` (a restarted
trainer that sees a group already claimed skips it).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agl_common.schemas import Rollout, TERMINAL
from agl_common.store import Store

from .loop import create_rollouts


@dataclass
class Group:
    """One GRPO group: ``n`` rollouts of one input, created under policy ``version``."""

    group_id: str
    rollout_ids: list[str]
    version: int
    created_at: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    rollouts: list[Rollout] = field(default_factory=list)


@dataclass
class Batch:
    """What :meth:`GroupScheduler.next_batch` hands out, with the counters of the wait."""

    groups: list[Group]
    stale_dropped: int
    carried_over: int
    ages: list[int]
    wait_s: float


class GroupScheduler:
    """Creates groups from an endless shuffled stream of task inputs and hands out complete ones.

    Args:
        store: the experiment store.
        inputs: task inputs to draw from (reshuffled with ``seed`` every pass).
        group_size: rollouts per group (n of GRPO).
        train_groups: groups per training step.
        active_groups: most groups in flight (≥ ``train_groups``; equal means synchronous).
        max_staleness: most policy versions between a group's creation and its training.
        tag: prefix of rollout and group ids (unique per run).
    """

    def __init__(self, store: Store, inputs: list[dict], group_size: int, train_groups: int,
                 active_groups: int | None = None, max_staleness: int = 1, tag: str = "run", seed: int = 0):
        if not inputs:
            raise ValueError("no task inputs to train on")
        self.store = store
        self.inputs = list(inputs)
        self.group_size = group_size
        self.train_groups = train_groups
        self.active_groups = max(active_groups or train_groups, train_groups)
        self.max_staleness = max_staleness
        self.tag = tag
        self.rng = random.Random(seed)
        self.active: dict[str, Group] = {}
        self._queue: list[dict] = []
        self._count = 0

    def _next_input(self) -> dict:
        if not self._queue:
            self._queue = self.inputs[:]
            self.rng.shuffle(self._queue)
        return self._queue.pop()

    async def top_up(self, version: int) -> int:
        """Start groups until ``active_groups`` are in flight; returns how many were started."""
        started = 0
        while len(self.active) < self.active_groups:
            tag = f"{self.tag}-q{self._count}"
            self._count += 1
            ids = await create_rollouts(self.store, [self._next_input()], self.group_size, tag, version)
            group = Group(f"{tag}-g0", ids, version)
            self.active[group.group_id] = group
            started += 1
        return started

    async def adopt(self, group: Group) -> None:
        """Track a group created elsewhere (e.g. by a trainer that was restarted)."""
        self.active[group.group_id] = group

    async def next_batch(self, version: int, timeout_s: float,
                         on_progress: Callable[[int, int], None] | None = None) -> Batch:
        """Wait for ``train_groups`` complete, fresh groups (dropping stale ones); top up as groups leave.

        Raises ``TimeoutError`` if not enough groups complete within ``timeout_s`` seconds.
        """
        t0 = time.monotonic()
        stale = 0
        await self.top_up(version)
        while True:
            groups = list(self.active.values())
            ids = [rid for g in groups for rid in g.rollout_ids]
            rollouts = {r.rollout_id: r for r in await self.store.get_rollouts(ids)}
            now = time.monotonic()
            for g in groups:
                g.rollouts = [rollouts[rid] for rid in g.rollout_ids]
                if g.done_at is None and all(r.status in TERMINAL for r in g.rollouts):
                    g.done_at = now
            for g in [g for g in groups if g.done_at is not None and version - g.version > self.max_staleness]:
                del self.active[g.group_id]
                stale += 1
            done = sorted((g for g in self.active.values() if g.done_at is not None), key=lambda g: g.done_at)
            if on_progress:
                on_progress(min(len(done), self.train_groups), self.train_groups)
            if len(done) >= self.train_groups:
                chosen = done[: self.train_groups]
                fresh = []
                for g in chosen:
                    del self.active[g.group_id]
                    if await self.store.r.sadd(self.store.key("trained"), g.group_id):
                        fresh.append(g)
                return Batch(fresh, stale, len(self.active), [version - g.version for g in fresh],
                             time.monotonic() - t0)
            if stale:
                await self.top_up(version)
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"fewer than {self.train_groups} groups completed in {timeout_s:.0f} s")
            await asyncio.sleep(0.5)
