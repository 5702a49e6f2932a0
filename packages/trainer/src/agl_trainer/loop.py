"""The run loop, one for every backend: it talks to the engine only through a
:class:`agl_trainer.backends.base.Backend` (sync = collocated async with one group in flight, see
:class:`agl_trainer.scheduler.GroupScheduler`).

One step::

    problems ─► n rollouts each (one GRPO group) ─► controller runs the harness ─► gateway records calls
      ─► wait until every rollout of the step is succeeded/failed
      ─► group policy (failed rollouts leave their group; groups under ``min_group_size`` are dropped)
      ─► rows from recorded token ids ─► per-rollout advantage (GRPO or RLOO baseline) broadcast to rows
      ─► collocated cycle (pause → drained → backend.update → backend.publish → resume on version N)

:func:`train_async` reads top to bottom: set up a :class:`TrainingRun`, then :meth:`TrainingRun.start` (the
held-out evaluation before) or :meth:`TrainingRun.resume` (from a checkpoint), :meth:`TrainingRun.step` until
the step or minute budget is spent, and :meth:`TrainingRun.finish` (the evaluation after, the summary).
The maths of a step (groups, rows, advantages) is :mod:`agl_trainer.algorithm`; starting the services and
choosing the backend is :mod:`agl_trainer.run`'s job; the step table, the curve and the time split
:mod:`agl_trainer.report`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

from agl_common.control import resume as resume_gateway
from agl_common.store import Store
from rich.console import Console
from rich.progress import Progress

from . import compute
from .algorithm.aggregate import Vocabulary
from .algorithm.batch import build_batch, select_groups
from .algorithm.evalstats import accuracy, reward_mean
from .algorithm.stepstats import TIME_KEYS, batch_signals, role_signals, rollout_phase_split
from .checkpoint import logged_metrics, save_checkpoint
from .config import TrainConfig
from .cycle import backend_cycle
from .hardware import describe
from .report import plot_curve, progress_bars, step_table, time_split_totals
from .scheduler import Group, GroupScheduler, evaluate
from .tasks import load_is_correct, load_tasks
from .lease import TrainerLease
from .trackers import Trackers


async def _always_owned() -> None:
    """A run driven without a lease (tests): always its prefix's."""


class TrainingRun:
    """One run against running services: its tasks, store, backend, trackers and what it measured so far.

    ``vocab``: the trained model's :class:`~agl_trainer.algorithm.aggregate.Vocabulary` (merge-break classes,
    end-of-turn ids, the bound on token ids; :func:`agl_trainer.model.load_vocabulary`); the loop loads no model.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, console: Console, store: Store, backend,
                 vocab: Vocabulary | None, progress: Progress):
        self.cfg, self.run_dir, self.console, self.store, self.backend = cfg, run_dir, console, store, backend
        self.vocab, self.progress = vocab, progress
        self.train = load_tasks(cfg.task_file, cfg.train_fn)
        self.heldout = load_tasks(cfg.task_file, cfg.heldout_fn)[: cfg.eval_size]
        self.subset = self.heldout[: cfg.eval_subset]
        self.is_correct = load_is_correct(cfg.task_file, cfg.correct_fn)
        self.metrics: list[dict] = []  # one per step, resumed steps included
        self.evals: list[dict] = []
        self.train_s = 0.0  # seconds of training steps so far (evaluations excluded)
        self.version = 0
        self.owned = _always_owned  # raises TrainerLive once another trainer holds the prefix (TrainerLease.confirm)
        # metrics.jsonl and each chosen experiment tracker; the run prints its own console lines
        self.trackers = Trackers(cfg.loggers, run_dir)
        self.show = "console" in cfg.loggers
        self.scheduler = GroupScheduler(store, self.train, cfg.group_size, cfg.groups_per_step, cfg.active_groups,
                                        cfg.max_staleness, tag=run_dir.name, seed=cfg.seed)

    async def start(self) -> int:
        """A new run: the gateway routes to the base policy (version 0), the held-out evaluation before.
        Returns the first step (1)."""
        self.trackers.log_config(self.cfg.shown())
        policy = self.cfg.base_policy()
        await self.store.set_policy(policy)
        await resume_gateway(self.store, policy=policy)
        await self.evaluate("before", 0, self.heldout)
        return 1

    async def resume(self, state: dict) -> int:
        """A restarted trainer (``state``: :func:`agl_trainer.checkpoint.load_checkpoint`): the backend restored,
        the checkpointed step's groups marked trained, its metrics line written if the kill came before it, the
        groups in flight adopted, the engine serving the restored policy. Returns the next step."""
        self.trackers.log_config(self.cfg.shown())
        self.version = state["version"]
        await compute.run(self.backend.restore, self.run_dir / "checkpoint")
        await self.store.commit_trained(self.scheduler.consumer_group, state["metrics"]["groups"], [])
        logged = logged_metrics(self.run_dir)  # (checked readable before anything started: check_resumable)
        if not any(m.get("step") == state["step"] and "eval" not in m for m in logged):
            self.trackers.log_metrics(state["metrics"], state["step"])  # killed between the checkpoint and this line
            logged.append(state["metrics"])
        # the table, curve and summary cover the whole run, not only the resumed part
        self.metrics += [m for m in logged if "eval" not in m and "step" in m and m["step"] <= state["step"]]
        self.evals += [e for e in logged if e.get("eval") and e.get("step", 0) <= state["step"]]
        self.train_s = sum(m["step_s"] for m in self.metrics if isinstance(m.get("step_s"), (int, float)))
        trained = [g for m in logged if isinstance(m.get("groups"), list) for g in m["groups"] if isinstance(g, str)]
        await self.scheduler.continue_after(trained + [g["group_id"] for g in state["active"]])
        lost = [g for g in state["active"]
                if await self.scheduler.adopt(Group(g["group_id"], g["rollout_ids"], g["version"])) == "missing"]
        if lost:
            self.console.print(f"{len(lost)} group(s) in flight at the checkpoint are not in this Redis (emptied, or "
                               "another one): dropped, their problems drawn again")
        taken = await self.scheduler.start()
        # the engine serves the restored policy (a CPU run's adapter is loaded again, in place)
        await resume_gateway(self.store, policy=await self.backend.serve(self.version))
        self.console.print(f"resumed {self.run_dir.name} after step {state['step']} (policy v{self.version}, "
                           f"groups in flight: {len(self.scheduler.active)}, completions taken over: {taken})")
        return state["step"] + 1

    async def evaluate(self, when: str, step: int, problems: list[dict]) -> dict | None:
        """The current policy on ``problems`` (the held-out set, or its fixed subset ``during`` training);
        logged to the trackers and kept for the curve. None when there are no problems (``eval_size: 0``)."""
        if not problems:
            return None
        t = time.perf_counter()
        task = self.progress.add_task(f"held-out eval ({when}, n={len(problems)})", total=len(problems))
        res = await evaluate(self.store, problems, f"{self.run_dir.name}-eval-{when}-{uuid.uuid4().hex[:6]}",
                             self.version, self.cfg.rollout_timeout_s, self.is_correct,
                             lambda d, _t: self.progress.update(task, completed=d), run=self.run_dir.name,
                             concurrency=self.cfg.concurrency)
        self.progress.remove_task(task)
        head = res["correct"][: len(self.subset)]
        res.update(when=when, step=step, policy_version=self.version, minutes=self.train_s / 60,
                   subset_accuracy=sum(head) / len(head), subset_n=len(head), eval_s=time.perf_counter() - t)
        self.evals.append(res)
        self.trackers.log_eval(when, res, step)
        if self.show:
            self.console.print(f"held-out accuracy {when} (step {step}, {self.train_s / 60:.1f} min of training): "
                               f"{res['accuracy']:.3f} ({sum(res['correct'])}/{res['n']}, failed {res['failed']}; "
                               f"{res['eval_s']:.0f} s)")
        return res

    async def step(self, step: int) -> dict:
        """One training step: the next batch of groups, rows and advantages, the collocated cycle (skipped
        without an advantage signal), the checkpoint (the step's commit point), the metrics line. Returns it."""
        cfg, store = self.cfg, self.store
        t0, t0_wall = time.perf_counter(), time.time()
        rtask = self.progress.add_task(f"  step {step} groups", total=cfg.groups_per_step)
        batch = await self.scheduler.next_batch(self.version, cfg.rollout_timeout_s * 4,
                                                lambda d, t: self.progress.update(rtask, completed=d))
        self.progress.remove_task(rtask)
        ready_wall = time.time()
        rollouts = [r for g in batch.groups for r in g.rollouts]
        calls = {r.rollout_id: await store.read_calls(r.rollout_id, r.attempt_id) for r in rollouts}
        kept, counts = select_groups(rollouts, cfg.min_group_size)
        rows, row_adv, astats, adv_stats = build_batch(kept, calls, cfg, self.vocab)
        m = {"step": step, "policy_version": self.version, "reward_mean": reward_mean(rollouts),
             "accuracy": accuracy(rollouts, self.is_correct),
             "calls_per_rollout": astats.calls / max(1, len(kept)), "rows": astats.rows,
             "merge_breaks": astats.merge_breaks, "failed": counts["failed"],
             "dropped_groups": counts["dropped_groups"], "rollout_s": batch.wait_s,
             "carried_over": batch.carried_over, "group_ages": batch.ages,
             "staleness_drops": batch.stale_dropped, "groups": [g.group_id for g in batch.groups],
             **batch_signals(rollouts, calls), **rollout_phase_split(rollouts, calls, t0_wall, ready_wall),
             **adv_stats, **astats.metrics()}
        if rows and any(abs(a) > 0 for a in row_adv):
            cycle = await backend_cycle(store, self.backend, self.version + 1, rows, row_adv, cfg.drain_s, self.owned)
            self.version += 1
            m.update(cycle, policy_version=self.version, time_update_s=cycle["update_s"],
                     time_pause_drain_s=cycle["drain_s"], time_weight_load_s=cycle["weight_load_s"])
        else:
            m["skipped_update"] = "no advantage signal" if rows else "no rows"
        if cfg.roles:  # each role's calls, reward, rows and (from its update) loss, entropy...
            signals = role_signals(rollouts, calls, rows)
            updates = m.get("roles", {})
            m["roles"] = {role: {**signals.get(role, {}), **updates.get(role, {})} for role in cfg.roles}
        await compute.run(save_checkpoint, self.run_dir, self.backend, step, self.version, self.scheduler, m)
        m["step_s"] = time.perf_counter() - t0
        # what the rollout phase and the cycle did not explain: bookkeeping, rows, the checkpoint
        m["time_idle_s"] = m["time_idle_s"] + max(0.0, m["step_s"] - sum(m.get(k) or 0.0 for k in TIME_KEYS))
        self.train_s += m["step_s"]
        self.trackers.log_metrics(m, step)  # metrics.jsonl and each chosen tracker
        await self.owned()  # (a trainer that lost its prefix commits nothing: the holder trains those groups)
        await self.scheduler.commit(batch.groups)
        self.metrics.append(m)
        if self.show:
            self.console.print(step_line(m, self.train_s))
        return m

    def out_of_time(self) -> bool:
        """The training budget (``max_train_minutes``) is spent."""
        return self.cfg.max_train_minutes is not None and self.train_s / 60 >= self.cfg.max_train_minutes

    def finish(self) -> dict:
        """The step table, the curve and ``summary.json`` (returned), after the evaluation after training."""
        cfg, metrics, evals, run_dir = self.cfg, self.metrics, self.evals, self.run_dir
        self.console.print(step_table(metrics))
        curve = run_dir / "accuracy_curve.png"
        if metrics:
            plot_curve(metrics, evals, curve)
        before = next((e for e in evals if e["when"] == "before"), None)
        after = next((e for e in reversed(evals) if e["when"] == "after"), None)
        first_update = next((m for m in metrics if "ratio_first" in m), {})
        summary = {"run_dir": str(run_dir), "model": cfg.model_name, "task_variant": cfg.task_variant,
                   "seed": cfg.seed, "steps": len(metrics),
                   "policy_version": metrics[-1]["policy_version"] if metrics else 0,
                   "heldout_before": before["accuracy"] if before else None,
                   "heldout_after": after["accuracy"] if after else None,
                   "heldout_n": len(self.heldout), "train_minutes": self.train_s / 60,
                   "eval_minutes": sum(e.get("eval_s", 0.0) for e in evals) / 60,
                   "first_update": {k: first_update.get(k) for k in ("ratio_first", "clip_frac_first", "kl")},
                   "curve": [{"minutes": e["minutes"], "step": e["step"], "when": e["when"],
                              "accuracy": e["accuracy"], "n": e["n"], "subset_accuracy": e["subset_accuracy"]}
                             for e in evals],
                   "curve_png": str(curve) if metrics else None, "hardware": describe(cfg.dtype),
                   **time_split_totals(metrics)}
        # the old names, kept for readers of earlier summaries
        summary["accuracy_before"], summary["accuracy_after"] = summary["heldout_before"], summary["heldout_after"]
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        t = summary
        self.console.print(f"held-out accuracy: before {fmt(t['heldout_before'])} → after {fmt(t['heldout_after'])} "
                           f"(n={len(self.heldout)}) after {t['train_minutes']:.1f} min of training ({t['steps']} "
                           f"steps; evaluations {t['eval_minutes']:.1f} min more)")
        self.console.print("where the training time went: " + ", ".join(
            f"{k.removeprefix('frac_')} {t[k]:.0%}" for k in t if k.startswith("frac_")))
        self.console.print(f"outputs in {run_dir}: summary.json, metrics.jsonl, {curve.name}, adapters/, logs/")
        return summary


def step_line(m: dict, train_s: float) -> str:
    """The console line of one step's metrics ``m`` (``train_s``: seconds of training so far)."""
    upd = (f"loss {m['loss']:+.3f}, ratio₀ {m['ratio_first']:.3f}, clip₀ {m['clip_frac_first']:.1%}, "
           f"KL {m['kl']:.4f}" + (f", entropy {m['entropy']:.3f}" if "entropy" in m else "")
           if "loss" in m else m["skipped_update"])
    roles = "".join(f"; {role}: {s.get('rows', 0)} rows" + (f", loss {s['loss']:+.3f}" if "loss" in s else ", skipped")
                    for role, s in (m.get("roles") or {}).items())
    return (f"step {m['step']}: reward {m['reward_mean']:.2f}, signal in {m['group_signal_frac']:.0%} of groups, "
            f"{m['truncation_rate']:.0%} of replies cut at max_tokens, {m['response_tokens_mean']:.0f} tokens/reply, "
            f"{upd}; {m['step_s']:.0f} s (generation {m['time_generation_s']:.0f} s, harness start-up "
            f"{m['time_harness_startup_s']:.0f} s, stragglers {m['time_wait_s']:.0f} s, update "
            f"{m.get('time_update_s', 0):.0f} s){roles}; {train_s / 60:.1f} min of training")


async def train_async(cfg: TrainConfig, run_dir: Path, console: Console, redis_url: str, state: dict | None,
                      backend, vocab: Vocabulary | None = None, lease: TrainerLease | None = None) -> dict:
    """The loop proper, against running services. Returns the summary (also written to ``summary.json``).

    ``state``: the checkpoint to resume from (:func:`agl_trainer.checkpoint.load_checkpoint`); the backend
    should already serve its version (the caller does it before any agent runs; the loop restores and serves
    it again). ``backend``: the :class:`agl_trainer.backends.base.Backend` that trains and serves the policy.
    ``vocab``: the base model's :class:`~agl_trainer.algorithm.aggregate.Vocabulary` (rows are built without one
    too: no merge-break classes, no stop-token check, no bound on ids). ``lease``: this trainer's lease of its prefix,
    taken by the caller before it started anything; None: taken here (and let go at the end). Raises
    :class:`agl_trainer.lease.TrainerLive` if another trainer holds the prefix, or takes it during the run (checked
    before each pause, publish and commit). Raises :class:`agl_trainer.tasks.TaskError`
    for an unusable task file.
    """
    store = Store(redis_url, cfg.prefix)
    # On a terminal: live progress bars. Otherwise (a pipe, a log): one line per event, nothing buffered.
    progress = progress_bars(console, disable=not console.is_terminal)
    try:
        run = TrainingRun(cfg, run_dir, console, store, backend, vocab, progress)
    except BaseException:
        await store.close()
        raise
    own = lease is None  # (a caller that started services first took it before them: run_training)
    if own:
        lease = TrainerLease(redis_url, cfg.prefix, run_dir.name)
    run.owned = lease.confirm
    try:
        if own:
            await asyncio.to_thread(lease.take)
        with progress:
            first = await (run.resume(state) if state is not None else run.start())
            steps = progress.add_task("training steps", total=cfg.steps, completed=first - 1)
            last = first - 1
            for step in range(first, cfg.steps + 1):
                await run.step(step)
                last = step
                progress.update(steps, advance=1)
                if run.out_of_time():
                    console.print(f"stopping after step {step}: {run.train_s / 60:.1f} min of training "
                                  f"(max_train_minutes {cfg.max_train_minutes:g})")
                    break
                if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                    await run.evaluate("during", step, run.subset)
            await run.evaluate("after", last, run.heldout)
    finally:
        run.trackers.close()
        if own:
            await asyncio.to_thread(lease.let_go)
        await store.close()
    return run.finish()
