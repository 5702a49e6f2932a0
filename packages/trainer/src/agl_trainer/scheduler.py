"""Which groups are in flight and which are trained next: synchronous and collocated-async RL.

Synchronous (``active_groups == train_groups``): start a batch of groups, wait for all, train.
Collocated async (``active_groups > train_groups``): keep up to ``active_groups`` groups running; train
on the first ``train_groups`` groups to complete; carry the rest over to the next step (their agents
keep running, held by the gateway during the update, and continue on the new policy). A group created
more than ``max_staleness`` policy versions ago is dropped when it completes (counted), never trained.
Heavy-tailed rollout durations make this ~2x faster end to end (bench/async_sim.py).

Completions reach the trainer through a Redis consumer group (``trainer:{tag}``) on ``P completed``,
the stream the store appends to right after every move to succeeded/failed. An entry
stays *pending* until its group is committed (trained: ``SADD P trained`` + ``XACK`` in one
transaction, after the checkpoint is written) or dropped as stale. A trainer killed mid-step leaves
its batch's entries pending; the restarted one takes them over (XAUTOCLAIM, :meth:`GroupScheduler.start`)
and trains those groups, while groups already in ``P trained`` are acknowledged and skipped: no group
is lost and none is trained twice. Statuses, not entries, decide completion (an entry is a wake-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agl_common.schemas import TERMINAL, GroupInfo, Rollout, RolloutStatus
from agl_common.store import Store

from .algorithm.evalstats import eval_stats


async def create_rollouts(store: Store, inputs: list[dict], n: int, tag: str, version: int,
                          owner: str | None = None, run: str | None = None) -> list[str]:
    """Create ``n`` rollouts per input (one group per input, ``group_id = {tag}-g{k}``); returns their ids.

    Each group is registered first (:meth:`Store.register_group`, with ``owner``: the trainer run that trains
    it, ``None`` for evaluations, and ``run``: the run it belongs to), so who owns a group, which run it is
    part of and which rollouts it has is read from the store, never parsed out of ids. Raises ``ValueError``
    if a group or rollout id exists already.
    """
    ids = []
    for k, inp in enumerate(inputs):
        gid = f"{tag}-g{k}"
        members = [f"{gid}-{i}" for i in range(n)]
        await store.register_group(GroupInfo(group_id=gid, rollout_ids=members, policy_version=version,
                                             owner=owner, run=run))
        for rid in members:
            await store.create_rollout(Rollout(rollout_id=rid, input=inp, group_id=gid, policy_version=version))
        ids += members
    return ids


async def wait_terminal(store: Store, ids: list[str], timeout_s: float,
                        on_progress: Callable[[int, int], None] | None = None) -> list[Rollout]:
    """Poll until every rollout is succeeded or failed; raises ``TimeoutError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        rollouts = await store.get_rollouts(ids)
        done = sum(r.status in TERMINAL for r in rollouts)
        if on_progress:
            on_progress(done, len(ids))
        if done == len(ids):
            return rollouts
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids) - done} of {len(ids)} rollouts unfinished after {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def withdraw(store: Store, ids: list[str]) -> int:
    """End each rollout of ``ids`` still ``queuing`` as ``failed`` (``withdrawn``): an evaluation interrupted or out
    of time left them queued, and the next controller on the prefix ran them first, under another policy, recorded
    ``succeeded`` under the first evaluation's run (round 23). Returns how many were withdrawn; a rollout already
    running is left to finish."""
    from agl_common.store import RolloutNotFound, UnreadableRecord

    withdrawn = 0

    def change(r: Rollout) -> None:
        nonlocal withdrawn
        if r.status == RolloutStatus.queuing:
            r.status, r.failure, r.ended_at = RolloutStatus.failed, "withdrawn", time.time()
            withdrawn += 1

    for rid in ids:
        with contextlib.suppress(RolloutNotFound, UnreadableRecord):
            await store.update_rollout(rid, change)
    return withdrawn


def eval_timeout_s(rollout_timeout_s: float, rollouts: int, concurrency: int) -> float:
    """How long an evaluation of ``rollouts`` may take in all: ``rollout_timeout_s`` per wave of ``concurrency``
    rollouts, and three more (queueing, harness start-up). It was ``4 * rollout_timeout_s`` whatever its size: 256
    problems × 8 samples at concurrency 32 failed unless each wave took under 11 s (round 23)."""
    return rollout_timeout_s * (math.ceil(rollouts / max(1, concurrency)) + 3)


async def evaluate(store: Store, problems: list[dict], tag: str, version: int, rollout_timeout_s: float,
                   is_correct: Callable[[dict, float | None], bool],
                   on_progress: Callable[[int, int], None] | None = None, n: int = 1,
                   run: str | None = None, concurrency: int = 1) -> dict:
    """``n`` rollouts per held-out problem (one group each) under the current policy; a failed rollout counts
    as wrong. It waits :func:`eval_timeout_s` in all (``TimeoutError``); interrupted or out of time, the rollouts it
    created that no controller has started are withdrawn (:func:`withdraw`).

    Returns :func:`agl_trainer.algorithm.evalstats.eval_stats`: ``accuracy`` (solved / rollouts, solved as the task's
    ``is_correct(input, reward)`` says, :func:`agl_trainer.tasks.load_is_correct`), ``n`` (rollouts), ``failed``, ``reward_mean``, ``correct`` (one 0/1 per rollout, in
    the order of ``problems``, their ``n`` samples together), ``pass_at_k``, the reward distribution and the
    per-rollout ``rewards``.
    """
    ids = await create_rollouts(store, problems, n, tag, version, run=run)
    try:
        rollouts = await wait_terminal(store, ids, eval_timeout_s(rollout_timeout_s, len(ids), concurrency),
                                       on_progress)
    except BaseException:  # (TimeoutError; Ctrl-C: asyncio.run cancels this task, which may still await here)
        with contextlib.suppress(Exception):
            await asyncio.shield(withdraw(store, ids))
        raise
    return eval_stats(rollouts, is_correct)



@dataclass
class Group:
    """One GRPO group: ``n`` rollouts of one input, created under policy ``version``."""

    group_id: str
    rollout_ids: list[str]
    version: int
    created_at: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    rollouts: list[Rollout] = field(default_factory=list)
    #: rollouts seen terminal, and the completion entries to acknowledge when the group is committed
    seen: set[str] = field(default_factory=set)
    entry_ids: list[str] = field(default_factory=list)


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
        tag: prefix of rollout and group ids (unique per run; also names the consumer group).
        consumer: this trainer's consumer name (default ``{host}-{pid}``).
    """

    def __init__(self, store: Store, inputs: list[dict], group_size: int, train_groups: int,
                 active_groups: int | None = None, max_staleness: int = 1, tag: str = "run", seed: int = 0,
                 consumer: str | None = None):
        if not inputs:
            raise ValueError("no task inputs to train on")
        self.store = store
        self.inputs = list(inputs)
        self.group_size = group_size
        self.train_groups = train_groups
        self.active_groups = max(active_groups or train_groups, train_groups)
        self.max_staleness = max_staleness
        self.tag = tag
        self.consumer_group = f"trainer:{tag}"
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.rng = random.Random(seed)
        self.active: dict[str, Group] = {}
        self._queue: list[dict] = []
        self._started = False

    def _next_input(self) -> dict:
        if not self._queue:
            self._queue = self.inputs[:]
            self.rng.shuffle(self._queue)
        return self._queue.pop()

    async def start(self) -> int:
        """Create the consumer group (at the stream's end) and take over every entry left pending by a
        trainer that died before committing; returns how many were taken over. Idempotent."""
        if self._started:
            return 0
        self._started = True
        await self.store.ensure_consumer_group(self.consumer_group)
        entries = await self.store.reclaim_completed(self.consumer_group, self.consumer)
        await self._take(entries)
        # groups adopted from a checkpoint: their statuses are the truth (an entry may have been acked)
        group_of = {rid: g for g in self.active.values() for rid in g.rollout_ids}
        for r in await self.store.get_rollouts(list(group_of)):
            if r.status in TERMINAL:
                group_of[r.rollout_id].seen.add(r.rollout_id)
        return len(entries)

    async def top_up(self, version: int) -> int:
        """Start groups until ``active_groups`` are in flight; returns how many were started.

        Group numbers come from ``INCR P groups:{tag}``, so a restarted trainer never reuses an id.
        """
        await self.start()
        started = 0
        while len(self.active) < self.active_groups:
            n = await self.store.next_group_number(self.tag)
            tag = f"{self.tag}-q{n}"
            ids = await create_rollouts(self.store, [self._next_input()], self.group_size, tag, version,
                                        owner=self.tag, run=self.tag)
            group = Group(f"{tag}-g0", ids, version)
            self.active[group.group_id] = group
            started += 1
        return started

    async def adopt(self, group: Group) -> str:
        """Track a group created elsewhere (by a trainer that was restarted). Returns ``"adopted"``, or why not:
        ``"trained"`` already, or ``"missing"``: the store no longer holds its rollouts (a Redis that lost its data:
        the run's own Redis dies with a killed trainer), its problem is drawn again."""
        if (await self.store.trained([group.group_id]))[0]:
            return "trained"
        if len(await self.store.get_rollouts(group.rollout_ids, skip_missing=True)) < len(group.rollout_ids):
            return "missing"
        self.active.setdefault(group.group_id, group)
        return "adopted"

    async def continue_after(self, group_ids: list[str]) -> None:
        """Never number a new group at or below the highest ``{tag}-q{n}`` of ``group_ids`` (the groups a resumed
        run already trained or had in flight), whatever the store's counter says (a Redis that lost its data
        would start again at 0, and the new groups would take the ids earlier steps' metrics name)."""
        head = f"{self.tag}-q"
        numbers = [int(m.group(1)) for g in group_ids if g.startswith(head)
                   and (m := re.fullmatch(r"(\d{1,18})-g\d+", g[len(head):]))]
        if numbers:
            await self.store.skip_group_numbers(self.tag, max(numbers) + 1)

    async def _take(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        """File completion entries under their groups; adopt our groups we do not know yet (created by a
        trainer that died); acknowledge at once what is not ours to train (other runs, evaluations, trained).

        Ownership and membership come from the store's group registry (:meth:`Store.groups`)."""
        acks, unknown = [], {}
        for eid, f in entries:
            gid, rid = f.get("gid", ""), f.get("rid", "")
            if gid in self.active:
                self.active[gid].seen.add(rid)
                self.active[gid].entry_ids.append(eid)
            elif gid:
                unknown.setdefault(gid, []).append((eid, rid))
            else:
                acks.append(eid)
        infos = dict(zip(unknown, await self.store.groups(list(unknown))))
        gids = [gid for gid, info in infos.items() if info is not None and info.owner == self.tag]
        acks += [eid for gid in unknown if gid not in gids for eid, _ in unknown[gid]]
        for gid, done in zip(gids, await self.store.trained(gids)):
            if done:
                acks += [eid for eid, _ in unknown[gid]]
                continue
            info = infos[gid]
            group = Group(gid, info.rollout_ids, info.policy_version)
            group.seen = {rid for _, rid in unknown[gid]}
            group.entry_ids = [eid for eid, _ in unknown[gid]]
            self.active[gid] = group
        await self.store.ack_completed(self.consumer_group, acks)

    async def commit(self, groups: list[Group]) -> None:
        """Mark ``groups`` trained and acknowledge their entries (one transaction). Call it after the
        update's checkpoint is written: a trainer killed before this point trains them after its restart."""
        await self.store.commit_trained(self.consumer_group, [g.group_id for g in groups],
                                        [e for g in groups for e in g.entry_ids])

    async def next_batch(self, version: int, timeout_s: float,
                         on_progress: Callable[[int, int], None] | None = None) -> Batch:
        """Wait for ``train_groups`` complete, fresh groups (dropping stale ones); top up as groups leave.

        The groups handed out stay pending until :meth:`commit`.
        Raises ``TimeoutError`` if not enough groups complete within ``timeout_s`` seconds.
        """
        t0 = time.monotonic()
        stale = 0
        await self.top_up(version)
        while True:
            now = time.monotonic()
            candidates = [g for g in self.active.values() if g.done_at is None and g.seen >= set(g.rollout_ids)]
            if candidates:
                rollouts = {r.rollout_id: r for r in await self.store.get_rollouts(
                    [rid for g in candidates for rid in g.rollout_ids])}
                for g in candidates:
                    g.rollouts = [rollouts[rid] for rid in g.rollout_ids]
                    if all(r.status in TERMINAL for r in g.rollouts):
                        g.done_at = now
                    else:  # retried since its entry: wait for the next one
                        g.seen -= {r.rollout_id for r in g.rollouts if r.status not in TERMINAL}
            for g in [g for g in self.active.values()
                      if g.done_at is not None and version - g.version > self.max_staleness]:
                del self.active[g.group_id]
                await self.store.ack_completed(self.consumer_group, g.entry_ids)
                stale += 1
            done = sorted((g for g in self.active.values() if g.done_at is not None), key=lambda g: g.done_at)
            if on_progress:
                on_progress(min(len(done), self.train_groups), self.train_groups)
            if len(done) >= self.train_groups:
                chosen = done[: self.train_groups]
                for g in chosen:
                    del self.active[g.group_id]
                return Batch(chosen, stale, len(self.active), [version - g.version for g in chosen],
                             time.monotonic() - t0)
            if stale:
                await self.top_up(version)
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"fewer than {self.train_groups} groups completed in {timeout_s:.0f} s")
            await self._take(await self.store.read_completed(self.consumer_group, self.consumer,
                                                             block_ms=max(1, int(min(left, 0.5) * 1000))))
