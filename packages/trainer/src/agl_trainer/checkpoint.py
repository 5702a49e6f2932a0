"""A run's checkpoint: ``{run_dir}/checkpoint`` holds the backend's weights and optimizer state, the step, the
policy version, the groups in flight and the step's metrics line; written atomically, once per step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from agl_common.schemas import PolicyVersion
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .files import read_jsonl, read_small_file
from .scheduler import GroupScheduler

#: Largest ``checkpoint/state.json`` read (a step's metrics and the groups in flight: a few KiB).
MAX_STATE_BYTES = 16 << 20
#: Largest ``metrics.jsonl`` a resume reads (a step's line is ~3 KB: ~20,000 steps), as the dashboard does.
MAX_METRICS_BYTES = 64 << 20


class NotResumable(ValueError):
    """A run directory that cannot be resumed: no checkpoint, an unreadable or malformed ``state.json``, or
    settings the checkpoint cannot be restored into (``agl_trainer.run.check_resumable``)."""


class _Metrics(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    groups: list[str]


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    group_id: str
    rollout_ids: list[str]
    version: PolicyVersion  # (0 to 2**63 - 1: a larger one was a traceback once the services were up; round 23)


class _State(BaseModel):
    """What :func:`save_checkpoint` writes to ``state.json``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    step: int = Field(ge=0)
    version: PolicyVersion
    metrics: _Metrics
    active: list[_Group]


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


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The state :func:`save_checkpoint` wrote under ``run_dir`` (``step``, ``version``, ``metrics``, ``active``),
    or None if there is no ``checkpoint/state.json``. Raises :class:`NotResumable` (one line) if it cannot be read
    or is not of that shape (round 15: a hand-edited or truncated ``state.json`` was a traceback, or ``{}``
    failed only after the engine had started)."""
    path = Path(run_dir) / "checkpoint" / "state.json"
    if not path.exists():
        return None
    try:
        state = json.loads(read_small_file(path, MAX_STATE_BYTES))  # (a FIFO or /dev/zero: round 17)
        _State.model_validate(state)
    except (OSError, ValueError, RecursionError) as exc:  # (ValidationError and JSONDecodeError are ValueErrors)
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'state'}: {e['msg']}" for e in exc.errors()[:3]) \
            if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}"
        raise NotResumable(f"{path} is not a checkpoint's state ({why[:300]})") from None
    return state


def run_config(run_dir: Path) -> dict[str, Any] | None:
    """The settings a run was started with (its ``config.json``, :meth:`TrainConfig.shown`), or None if it has
    none. Raises ``ValueError`` (one line) if it cannot be read or is not a JSON object (a FIFO, a device, a
    hand-edited file: :func:`~agl_trainer.files.read_small_file`)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    try:
        data = json.loads(read_small_file(path, MAX_STATE_BYTES))
    except RecursionError:
        data = None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a run's config (a JSON object)")
    return data


def logged_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of the run's ``metrics.jsonl`` that a resume continues from: JSON objects whose ``step`` (if any)
    is an integer; a line cut by a kill mid-append, a blank one or a foreign one is skipped. ``[]`` if the file
    does not exist. Raises ``ValueError`` (one line) for a file that is not a regular file of at most
    :data:`MAX_METRICS_BYTES` or cannot be read (:func:`~agl_trainer.files.read_jsonl`)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() and not path.is_symlink():
        return []
    return [m for m in read_jsonl(path, MAX_METRICS_BYTES)
            if "step" not in m or (isinstance(m["step"], int) and not isinstance(m["step"], bool))]


def weight_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What a run's weights and optimizer state are shaped by, from its settings (``config.json`` or
    :meth:`TrainConfig.shown`): ``base_model`` and each adapter's ``[lora_rank, lora_alpha]`` (key: its role, or
    ``""`` without roles; a role without its own uses the run's). Another rank cannot be loaded into; another
    alpha or base model would train a policy the engine does not serve. Raises ``ValueError`` for settings of
    the wrong shape."""
    from .config import TrainConfig

    fields = TrainConfig.model_fields
    rank, alpha = (config.get(k, fields[k].default) for k in ("lora_rank", "lora_alpha"))
    roles = config.get("roles") or {}
    if not isinstance(roles, dict) or not all(isinstance(rc, dict) for rc in roles.values()):
        raise ValueError("roles is not a mapping of role settings")
    adapters = {role: [rc.get("lora_rank") or rank, rc.get("lora_alpha") or alpha] for role, rc in roles.items()}
    return {"base_model": config.get("base_model"), "adapters": adapters or {"": [rank, alpha]}}


def resume_state(run_dir: Path) -> dict[str, Any]:
    """:func:`load_checkpoint` of a run to resume. Raises :class:`NotResumable` if it has none (or a bad one)."""
    state = load_checkpoint(run_dir)
    if state is None:
        raise NotResumable(f"{run_dir} has no checkpoint to resume from (no checkpoint/state.json: a run is "
                           "checkpointed after each step)")
    return state
