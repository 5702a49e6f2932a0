"""The synchronous GRPO loop: create groups of rollouts, wait, build rows, update, repeat.

One step::

    problems ─► n rollouts each (one GRPO group) ─► controller runs the harness ─► gateway records calls
      ─► wait until every rollout of the step is succeeded/failed
      ─► group policy (failed rollouts leave their group; groups under ``min_group_size`` are dropped)
      ─► rows from recorded token ids ─► per-rollout advantage (GRPO or RLOO baseline) broadcast to rows
      ─► collocated cycle (pause → drained → PPO step → adapter hot-load → resume on policy-v{N})
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from agl_common.schemas import Rollout, RolloutStatus, TERMINAL
from agl_common.store import Store

from .advantage import rollout_advantages
from .aggregate import AggregateStats, Row, build_rows
from .config import TrainConfig
from .evalstats import eval_stats


def _task_module(task_file: str | Path):
    path = Path(task_file)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} not found (run from the repository root?)")
    spec = importlib.util.spec_from_file_location(f"agl_task_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tasks(task_file: str | Path, fn: str) -> list[dict]:
    """Call ``fn()`` from the Python file ``task_file``; it returns the task inputs (dicts).

    Raises ``FileNotFoundError`` if the file is missing, ``AttributeError`` if ``fn`` is not in it.
    """
    return list(getattr(_task_module(task_file), fn)())


def default_is_correct(task: dict, reward: float | None) -> bool:
    """Used when the task file defines no ``is_correct``: a reward of at least 1 counts as solved."""
    return reward is not None and reward >= 1.0


def load_is_correct(task_file: str | Path, fn: str | None = "is_correct") -> Callable[[dict, float | None], bool]:
    """The task's own notion of a solved input, ``fn(task, reward) -> bool`` from ``task_file`` (its
    ``is_correct`` by default), or :func:`default_is_correct` if the file has none."""
    return getattr(_task_module(task_file), fn or "is_correct", default_is_correct)


async def create_rollouts(store: Store, inputs: list[dict], n: int, tag: str, version: int) -> list[str]:
    """Create ``n`` rollouts per input (one group per input, ``group_id = {tag}-g{k}``); returns their ids."""
    ids = []
    for k, inp in enumerate(inputs):
        for i in range(n):
            rid = f"{tag}-g{k}-{i}"
            await store.create_rollout(Rollout(rollout_id=rid, input=inp, group_id=f"{tag}-g{k}",
                                               policy_version=version))
            ids.append(rid)
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


def select_groups(rollouts: list[Rollout], min_group_size: int) -> tuple[list[Rollout], dict[str, int]]:
    """Keep succeeded rollouts with a reward, in groups that still have ``min_group_size`` of them.

    Failed rollouts (timeouts, crashes, no model calls) never count as reward 0: they leave their group.
    """
    groups: dict[str, list[Rollout]] = {}
    counts = {"failed": 0, "dropped_groups": 0}
    for r in rollouts:
        if r.status == RolloutStatus.succeeded and r.reward is not None:
            groups.setdefault(r.group_id or r.rollout_id, []).append(r)
        else:
            counts["failed"] += 1
    kept = []
    for members in groups.values():
        if len(members) >= min_group_size:
            kept += members
        else:
            counts["dropped_groups"] += 1
    return kept, counts


async def build_batch(store: Store, rollouts: list[Rollout], cfg: TrainConfig,
                      decode: Callable[[list[int]], str] | None = None, eos_token_ids: set[int] | None = None,
                      calls: dict[str, list] | None = None) -> tuple[list[Row], list[float], AggregateStats, dict[str, float]]:
    """Rows and per-row advantages for the kept rollouts; rollouts that yield no row leave the statistics.

    The advantage is computed once per rollout with ``cfg.advantage`` (``grpo`` or ``rloo``, see
    :func:`agl_trainer.advantage.rollout_advantages`) and repeated for each of the rollout's rows.

    ``decode`` (token ids → text) and ``eos_token_ids`` go to :func:`build_rows` (merge-break classes).
    ``calls``: the rollouts' call records already read (rollout id → records); read from ``store`` if absent.
    """
    stats = AggregateStats()
    per_rollout: list[tuple[Rollout, list[Row]]] = []
    for r in rollouts:
        recs = calls[r.rollout_id] if calls is not None else await store.read_calls(r.rollout_id, r.attempt_id)
        rows = build_rows(recs, cfg.aggregation, stats,
                          decode=decode, eos_token_ids=eos_token_ids, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_response_tokens=cfg.max_response_tokens)
        if rows:
            per_rollout.append((r, rows))
    if not per_rollout:
        return [], [], stats, {}
    group_ids = {g: k for k, g in enumerate(sorted({r.group_id for r, _ in per_rollout}))}
    rewards = torch.tensor([r.reward for r, _ in per_rollout])
    adv = rollout_advantages(rewards, torch.tensor([group_ids[r.group_id] for r, _ in per_rollout]),
                             cfg.advantage, cfg.norm_by_std)
    rows, row_adv = [], []
    for (r, rs), a in zip(per_rollout, adv.tolist()):
        rows += rs
        row_adv += [a] * len(rs)
    return rows, row_adv, stats, {"adv_abs_mean": float(adv.abs().mean())}


async def evaluate(store: Store, problems: list[dict], tag: str, version: int, timeout_s: float,
                   on_progress: Callable[[int, int], None] | None = None,
                   is_correct: Callable[[dict, float | None], bool] = default_is_correct, n: int = 1) -> dict:
    """``n`` rollouts per held-out problem (one group each) under the current policy; a failed rollout counts
    as wrong.

    Returns :func:`agl_trainer.evalstats.eval_stats`: ``accuracy`` (solved / rollouts, solved as the task's
    ``is_correct`` says), ``n`` (rollouts), ``failed``, ``reward_mean``, ``correct`` (one 0/1 per rollout, in
    the order of ``problems``, their ``n`` samples together), ``pass_at_k``, the reward distribution and the
    per-rollout ``rewards``.
    """
    ids = await create_rollouts(store, problems, n, tag, version)
    return eval_stats(await wait_terminal(store, ids, timeout_s, on_progress), is_correct)


def new_run_id() -> str:
    return time.strftime("%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
