"""A run's checkpoint: ``{run_dir}/checkpoint`` holds the backend's weights and optimizer state, the step, the
policy version, the groups in flight and the step's metrics line; written atomically, once per step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .scheduler import GroupScheduler


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
