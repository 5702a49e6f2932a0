"""The run loop, one for every backend: it talks to the engine only through a
:class:`agl_trainer.backends.base.Backend` (sync = collocated async with one group in flight, see
:class:`agl_trainer.scheduler.GroupScheduler`).

One step::

    problems ─► n rollouts each (one GRPO group) ─► controller runs the harness ─► gateway records calls
      ─► wait until every rollout of the step is succeeded/failed
      ─► group policy (failed rollouts leave their group; groups under ``min_group_size`` are dropped)
      ─► rows from recorded token ids ─► per-rollout advantage (GRPO or RLOO baseline) broadcast to rows
      ─► collocated cycle (pause → drained → backend.update → backend.publish → resume on version N)

:func:`train_async` is the loop; the functions before it are its steps. Starting the services and choosing
the backend is :mod:`agl_trainer.run`'s job; the step table, the curve and the time split
:mod:`agl_trainer.report`'s.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from agl_common.control import resume as resume_gateway
from agl_common.schemas import Policy, Rollout, RolloutStatus, TERMINAL
from agl_common.store import Store
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import compute
from .advantage import row_advantages
from .aggregate import AggregateStats, Row, build_rows
from .config import TrainConfig
from .hardware import describe
from .report import plot_curve, step_table, time_split_totals
from .scheduler import Group, GroupScheduler, create_rollouts  # noqa: F401 (create_rollouts: re-exported)
from .stepstats import TIME_KEYS, batch_signals, rollout_phase_split
from .trackers import Trackers
from .evalstats import accuracy, eval_stats, reward_mean


class TaskError(ValueError):
    """The task file or one of its functions cannot be used; the message says which and why."""


def _task_module(task_file: str | Path):
    """Import ``task_file``. Raises :class:`TaskError` if it is missing or fails to import."""
    path = Path(task_file)
    if not path.is_file():
        raise TaskError(f"task file {path} not found (run from the repository root?)")
    spec = importlib.util.spec_from_file_location(f"agl_task_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error of the user's file, reported as theirs
        raise TaskError(f"task file {path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _task_function(module, task_file: str | Path, fn: str) -> Callable:
    f = getattr(module, fn, None)
    if not callable(f):
        known = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise TaskError(f"task file {task_file} has no function {fn!r} (its functions: {', '.join(known) or 'none'})")
    return f


def load_tasks(task_file: str | Path, fn: str) -> list[dict]:
    """Call ``fn()`` from the Python file ``task_file``; it returns the task inputs (dicts).

    Raises :class:`TaskError` if the file is missing or fails to import, or has no function ``fn``.
    """
    return list(_task_function(_task_module(task_file), task_file, fn)())


def default_is_correct(task: dict, reward: float | None) -> bool:
    """Used when the task file defines no ``is_correct``: a reward of at least 1 counts as solved."""
    return reward is not None and reward >= 1.0


def load_is_correct(task_file: str | Path, fn: str | None = "is_correct") -> Callable[[dict, float | None], bool]:
    """The task's own notion of a solved input, ``fn(task, reward) -> bool`` from ``task_file``: its
    ``is_correct`` by default, or :func:`default_is_correct` if the file has none. Another name that is not
    in the file raises :class:`TaskError` (a misspelt name never falls back silently)."""
    module = _task_module(task_file)
    if (fn or "is_correct") == "is_correct" and not callable(getattr(module, "is_correct", None)):
        return default_is_correct
    return _task_function(module, task_file, fn)


def check_task(cfg: TrainConfig, train: bool = True) -> None:
    """Before any service starts: the task file imports and has ``cfg.train_fn`` (if ``train``; an evaluation
    needs none), ``cfg.heldout_fn`` and ``cfg.correct_fn`` (unless that is the default ``is_correct`` and
    absent). Raises :class:`TaskError`."""
    module = _task_module(cfg.task_file)
    for fn in ([cfg.train_fn] if train else []) + [cfg.heldout_fn]:
        _task_function(module, cfg.task_file, fn)
    load_is_correct(cfg.task_file, cfg.correct_fn)


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

    Advantages: :func:`agl_trainer.advantage.row_advantages` with ``cfg.advantage`` (``grpo`` or ``rloo``) at
    ``cfg.advantage_level`` (``rollout``: once per rollout, repeated for each of its rows; ``row``: each row a
    sample). The one batch builder: training steps and ``rollouts export --shape rows`` both call it.

    ``decode`` (token ids → text) and ``eos_token_ids`` go to :func:`build_rows` (merge-break classes).
    ``calls``: the rollouts' call records already read (rollout id → records); read from ``store`` if absent.

    Returns ``(rows, row advantages, aggregation stats, stats)``; ``stats``: ``adv_abs_mean`` (mean |A| over the
    rollouts), ``rollouts_trained`` (rollouts that gave a row) and ``multi_row_rollouts`` (those with several).
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
    group_ids = {g: k for k, g in enumerate(sorted({r.group_id or r.rollout_id for r, _ in per_rollout}))}
    n_rows = torch.tensor([len(rs) for _, rs in per_rollout])
    adv = row_advantages(torch.tensor([float(r.reward) for r, _ in per_rollout]),
                         torch.tensor([group_ids[r.group_id or r.rollout_id] for r, _ in per_rollout]),
                         n_rows, cfg.advantage_level, cfg.advantage, cfg.norm_by_std)
    rows = [row for _, rs in per_rollout for row in rs]
    first = torch.cumsum(n_rows, 0) - n_rows  # each rollout's first row: its rows share one value at either level
    return rows, adv.tolist(), stats, {"adv_abs_mean": float(adv[first].abs().mean()),
                                       "rollouts_trained": len(per_rollout),
                                       "multi_row_rollouts": int((n_rows > 1).sum())}


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


def save_checkpoint(run_dir: Path, backend, step: int, version: int, scheduler: GroupScheduler,
                    metrics: dict) -> None:
    """Write ``{run_dir}/checkpoint``: LoRA weights, optimizer state, step, version, groups in flight and
    the step's metrics line (whose ``groups`` are the groups it trained).

    Written to a temporary directory and renamed, so a trainer killed mid-write keeps the previous one.
    The rename is the step's commit point: a restarted trainer re-marks ``metrics["groups"]`` as trained
    (if the kill came before :meth:`GroupScheduler.commit`) and re-appends ``metrics`` if its line is missing.
    """
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    backend.checkpoint(tmp)
    state = {"step": step, "version": version, "metrics": metrics,
             "active": [{"group_id": g.group_id, "rollout_ids": g.rollout_ids, "version": g.version}
                        for g in scheduler.active.values()]}
    (tmp / "state.json").write_text(json.dumps(state))
    old = run_dir / "checkpoint"
    if old.exists():
        shutil.rmtree(run_dir / "checkpoint.old", ignore_errors=True)
        old.rename(run_dir / "checkpoint.old")
    tmp.rename(old)
    shutil.rmtree(run_dir / "checkpoint.old", ignore_errors=True)


def load_checkpoint(run_dir: Path) -> dict | None:
    path = run_dir / "checkpoint" / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


async def train_async(cfg: TrainConfig, run_dir: Path, console: Console, redis_url: str, state: dict | None,
                      backend) -> dict:
    """The loop proper, against running services. Returns the summary (also written to ``summary.json``).

    ``state``: the checkpoint to resume from (:func:`load_checkpoint`); the backend should already serve its
    version (the caller does it before any agent runs; the loop restores and serves it again).
    ``backend``: the :class:`agl_trainer.backends.base.Backend` that trains and serves the policy.
    """
    from transformers import AutoTokenizer

    from .aggregate import end_of_turn_ids
    from .cycle import backend_cycle
    from .model import ensure_base_model

    train = load_tasks(cfg.task_file, cfg.train_fn)
    heldout = load_tasks(cfg.task_file, cfg.heldout_fn)[: cfg.eval_size]
    subset = heldout[: cfg.eval_subset]
    is_correct = load_is_correct(cfg.task_file, cfg.correct_fn)
    store = Store(redis_url, cfg.prefix)
    run_id = run_dir.name
    metrics_path = run_dir / "metrics.jsonl"
    metrics, evals = [], []
    train_s = 0.0  # seconds of training steps so far (evaluations excluded)
    # metrics.jsonl and each chosen experiment tracker; the run prints its own console lines (below)
    trackers = Trackers([n for n in cfg.loggers if n != "console"], run_dir, console)
    show = "console" in cfg.loggers
    try:
        trackers.log_config(cfg.model_dump(mode="json"))
        if state is None:
            await store.set_policy(Policy(model=cfg.model_name, version=0))
            await resume_gateway(store, model=cfg.model_name, version=0)
        base_dir = ensure_base_model(cfg.base_model)
        # once per run: decodes merge breaks for their classes/examples, and the end-of-turn ids
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, base_dir)
        eos_ids = end_of_turn_ids(tokenizer, base_dir)
        # On a terminal: live progress bars. Otherwise (a pipe, a log): one line per event, nothing buffered.
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as progress:

            async def run_eval(when: str, version: int, step: int, problems: list[dict]) -> dict | None:
                if not problems:  # eval_size: 0
                    return None
                t = time.perf_counter()
                task = progress.add_task(f"held-out eval ({when}, n={len(problems)})", total=len(problems))
                res = await evaluate(store, problems, f"{run_id}-eval-{when}-{uuid.uuid4().hex[:6]}", version,
                                     cfg.rollout_timeout_s * 4, lambda d, _t: progress.update(task, completed=d),
                                     is_correct)
                progress.remove_task(task)
                head = res["correct"][: len(subset)]
                res.update(when=when, step=step, policy_version=version, minutes=train_s / 60,
                           subset_accuracy=sum(head) / len(head), subset_n=len(head),
                           eval_s=time.perf_counter() - t)
                evals.append(res)
                trackers.log_eval(when, res, step)
                if show:
                    console.print(f"held-out accuracy {when} (step {step}, {train_s / 60:.1f} min of training): "
                                  f"{res['accuracy']:.3f} ({sum(res['correct'])}/{res['n']}, failed {res['failed']}; "
                                  f"{res['eval_s']:.0f} s)")
                return res

            version, first_step = 0, 1
            scheduler = GroupScheduler(store, train, cfg.group_size, cfg.groups_per_step, cfg.active_groups,
                                       cfg.max_staleness, tag=run_id, seed=cfg.seed)
            if state is not None:  # a restarted trainer: same policy, same groups in flight, next step
                version, first_step = state["version"], state["step"] + 1
                await compute.run(backend.restore, run_dir / "checkpoint")
                await store.commit_trained(scheduler.consumer_group, state["metrics"]["groups"], [])
                logged = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
                if not any(m.get("step") == state["step"] and "eval" not in m for m in logged):
                    with metrics_path.open("a") as f:  # killed between the checkpoint and this line
                        f.write(json.dumps(state["metrics"]) + "\n")
                    logged.append(state["metrics"])
                # the table, curve and summary cover the whole run, not only the resumed part
                metrics += [m for m in logged if "eval" not in m and "step" in m and m["step"] <= state["step"]]
                evals += [e for e in logged if e.get("eval") and e.get("step", 0) <= state["step"]]
                train_s = sum(m.get("step_s", 0.0) for m in metrics)
                for g in state["active"]:
                    await scheduler.adopt(Group(g["group_id"], g["rollout_ids"], g["version"]))
                taken = await scheduler.start()
                # the engine serves the restored policy (a CPU run's adapter is loaded again, in place)
                await resume_gateway(store, model=await backend.serve(version), version=version)
                console.print(f"resumed {run_dir.name} after step {state['step']} (policy v{version}, "
                              f"groups in flight: {len(scheduler.active)}, completions taken over: {taken})")
            else:
                await run_eval("before", 0, 0, heldout)
            steps_task = progress.add_task("training steps", total=cfg.steps, completed=first_step - 1)
            last = first_step - 1
            for step in range(first_step, cfg.steps + 1):
                t0, t0_wall = time.perf_counter(), time.time()
                rtask = progress.add_task(f"  step {step} groups", total=cfg.groups_per_step)
                batch = await scheduler.next_batch(version, cfg.rollout_timeout_s * 4,
                                                   lambda d, t: progress.update(rtask, completed=d))
                ready_wall = time.time()
                rollouts = [r for g in batch.groups for r in g.rollouts]
                calls = {r.rollout_id: await store.read_calls(r.rollout_id, r.attempt_id) for r in rollouts}
                kept, counts = select_groups(rollouts, cfg.min_group_size)
                rows, row_adv, astats, adv_stats = await build_batch(store, kept, cfg, tokenizer.decode, eos_ids,
                                                                     calls)
                m = {"step": step, "policy_version": version, "reward_mean": reward_mean(rollouts),
                     "accuracy": accuracy(rollouts, is_correct),
                     "calls_per_rollout": astats.calls / max(1, len(kept)), "rows": astats.rows,
                     "merge_breaks": astats.merge_breaks, "failed": counts["failed"],
                     "dropped_groups": counts["dropped_groups"], "rollout_s": batch.wait_s,
                     "carried_over": batch.carried_over, "group_ages": batch.ages,
                     "staleness_drops": batch.stale_dropped, "groups": [g.group_id for g in batch.groups],
                     **batch_signals(rollouts, calls), **rollout_phase_split(rollouts, calls, t0_wall, ready_wall),
                     **adv_stats, **astats.metrics()}
                if rows and any(abs(a) > 0 for a in row_adv):
                    cycle = await backend_cycle(store, backend, version + 1, rows, row_adv, cfg.drain_timeout_s)
                    version += 1
                    m.update(cycle)
                    m["policy_version"] = version
                    m["time_update_s"] = cycle["update_s"]
                    m["time_pause_drain_s"] = cycle["drain_s"]
                    m["time_weight_load_s"] = cycle["weight_load_s"]
                else:
                    m["skipped_update"] = "no advantage signal" if rows else "no rows"
                await compute.run(save_checkpoint, run_dir, backend, step, version, scheduler, m)
                m["step_s"] = time.perf_counter() - t0
                # what the rollout phase and the cycle did not explain: bookkeeping, rows, the checkpoint
                m["time_idle_s"] = m["time_idle_s"] + max(0.0, m["step_s"] - sum(m.get(k) or 0.0 for k in TIME_KEYS))
                train_s += m["step_s"]
                trackers.log_metrics(m, step)  # metrics.jsonl and each chosen tracker
                await scheduler.commit(batch.groups)
                metrics.append(m)
                last = step
                progress.update(steps_task, advance=1)
                progress.remove_task(rtask)
                if show:  # the console tracker's line
                    upd = (f"loss {m['loss']:+.3f}, ratio₀ {m['ratio_first']:.3f}, clip₀ {m['clip_frac_first']:.1%}, "
                           f"KL {m['kl']:.4f}" + (f", entropy {m['entropy']:.3f}" if "entropy" in m else "")
                           if "loss" in m else m["skipped_update"])
                    console.print(f"step {step}: reward {m['reward_mean']:.2f}, signal in {m['group_signal_frac']:.0%} "
                                  f"of groups, {m['truncation_rate']:.0%} of replies cut at max_tokens, "
                                  f"{m['response_tokens_mean']:.0f} tokens/reply, {upd}; {m['step_s']:.0f} s "
                                  f"(generation {m['time_generation_s']:.0f} s, harness start-up "
                                  f"{m['time_harness_startup_s']:.0f} s, stragglers {m['time_wait_s']:.0f} s, update "
                                  f"{m.get('time_update_s', 0):.0f} s); {train_s / 60:.1f} min of training")
                out_of_time = cfg.max_train_minutes is not None and train_s / 60 >= cfg.max_train_minutes
                if out_of_time:
                    console.print(f"stopping after step {step}: {train_s / 60:.1f} min of training "
                                  f"(max_train_minutes {cfg.max_train_minutes:g})")
                if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and not out_of_time:
                    await run_eval("during", version, step, subset)
                if out_of_time:
                    break
            await run_eval("after", version, last, heldout)
    finally:
        trackers.close()
        await store.close()
    console.print(step_table(metrics))
    curve = run_dir / "accuracy_curve.png"
    if metrics:
        plot_curve(metrics, evals, curve)
    before = next((e for e in evals if e["when"] == "before"), None)
    after = next((e for e in reversed(evals) if e["when"] == "after"), None)
    first_update = next((m for m in metrics if "ratio_first" in m), {})
    summary = {"run_dir": str(run_dir), "model": cfg.model_name, "task_variant": cfg.task_variant, "seed": cfg.seed,
               "steps": len(metrics), "policy_version": metrics[-1]["policy_version"] if metrics else 0,
               "heldout_before": before["accuracy"] if before else None,
               "heldout_after": after["accuracy"] if after else None,
               "heldout_n": len(heldout), "train_minutes": train_s / 60,
               "eval_minutes": sum(e.get("eval_s", 0.0) for e in evals) / 60,
               "first_update": {k: first_update.get(k) for k in ("ratio_first", "clip_frac_first", "kl")},
               "curve": [{"minutes": e["minutes"], "step": e["step"], "when": e["when"], "accuracy": e["accuracy"],
                          "n": e["n"], "subset_accuracy": e["subset_accuracy"]} for e in evals],
               "curve_png": str(curve) if metrics else None, "hardware": describe(cfg.dtype),
               **time_split_totals(metrics)}
    # the old names, kept for readers of earlier summaries
    summary["accuracy_before"], summary["accuracy_after"] = summary["heldout_before"], summary["heldout_after"]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    t = summary
    console.print(f"held-out accuracy: before {fmt(t['heldout_before'])} → after {fmt(t['heldout_after'])} "
                  f"(n={len(heldout)}) after {t['train_minutes']:.1f} min of training ({t['steps']} steps; "
                  f"evaluations {t['eval_minutes']:.1f} min more)")
    console.print("where the training time went: " + ", ".join(
        f"{k.removeprefix('frac_')} {t[k]:.0%}" for k in t if k.startswith("frac_")))
    console.print(f"outputs in {run_dir}: summary.json, metrics.jsonl, {curve.name}, adapters/, logs/")
    return summary
