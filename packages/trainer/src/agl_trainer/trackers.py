"""Experiment trackers: each training step's metrics and each evaluation, sent to every chosen tracker.

Names as verl's ``trainer.logger``: ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``. Each
tracker is written through its own library; nothing here re-implements a file format:

=============  ==========================================================================================
``console``    one line per step and per evaluation on the run's console, printed by the run itself
               (:func:`agl_trainer.loop.step_line`); no tracker object here
``jsonl``      ``{run_dir}/metrics.jsonl``: each step's metrics dict as it is, and ``{"eval": when, ...}``
               lines (CONTRACT §5). Always written, chosen or not: it is the run's own record (the
               summary, the curve and ``--resume`` read it back)
``tensorboard````torch.utils.tensorboard.SummaryWriter`` in ``{run_dir}/tensorboard``
``wandb``      ``wandb.init(mode=$WANDB_MODE or "offline", dir=run_dir)``: ``{run_dir}/wandb/offline-run-*``
               (``wandb sync`` uploads it); ``WANDB_PROJECT`` (default ``agl``), ``WANDB_ENTITY`` apply
``mlflow``     ``MlflowClient`` against ``$MLFLOW_TRACKING_URI``, default ``sqlite:///{out_dir}/mlflow.db``
               (one database for every run of ``out_dir``); experiment ``$MLFLOW_EXPERIMENT_NAME`` or the
               ``out_dir`` folder name; run name = the run id
=============  ==========================================================================================

What each numeric tracker receives (tensorboard, wandb, mlflow): :func:`flatten` of the step's metrics
under ``train/`` at ``step``, and of each evaluation under ``eval/`` at the step it was taken (``before``:
0, ``after``: the last step). Lists and strings (group ids, merge-break examples) stay in ``metrics.jsonl``
only. The config is logged once per run: wandb ``config``, mlflow params (flattened, stringified),
tensorboard a ``config`` text (the JSON).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

#: Every tracker name, in verl's spelling.
TRACKERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
#: What to install for a tracker whose library is missing (pins as in requirements.txt).
INSTALL = {"tensorboard": "tensorboard==2.20.0",
           "wandb": "wandb==0.31.0",
           "mlflow": "mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1"}
#: Modules a tracker imports (all must be present).
MODULES = {"tensorboard": ("tensorboard", "torch"), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}


class TrackerMissing(RuntimeError):
    """A chosen tracker's library is not installed; the message says what to install (one line)."""


def find_spec(name: str):
    """``importlib.util.find_spec`` (a seam: the tests hide a library through it)."""
    return importlib.util.find_spec(name)


def mlflow_uri(out_dir: Path) -> str:
    """MLflow's tracking URI: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///{out_dir}/mlflow.db`` (``out_dir`` made
    absolute: the run directory's parent).

    Raises:
        ValueError: (no ``$MLFLOW_TRACKING_URI``) ``out_dir`` holds ``?`` or ``%``, which a sqlite URL reads as its
            query or an escape: the database would be written elsewhere (``exp?1`` → ``exp``) or not at all
            (``%41`` → minutes of retries); quoted, MLflow still makes a directory of the quoted name.
    """
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    path = Path(out_dir).resolve() / "mlflow.db"
    if "?" in str(path) or "%" in str(path):
        raise ValueError(f"logger 'mlflow': the run directory {str(path.parent)!r} holds '?' or '%', which its "
                         "sqlite URL cannot: choose another out_dir or set MLFLOW_TRACKING_URI")
    return f"sqlite:///{path}"


#: The values of ``WANDB_MODE`` wandb takes.
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


def check_trackers(names: Iterable[str], out_dir: Path | None = None) -> list[str]:
    """Validate tracker names; returns them without duplicates, in order. With ``out_dir`` (where the run
    directories go), also what each tracker derives from it (:func:`mlflow_uri`).

    Raises:
        ValueError: an unknown name (the message lists the known ones); an ``out_dir`` a tracker cannot use.
        TrackerMissing: a chosen tracker's library is not installed (the message says what to pip install).
    """
    out: list[str] = []
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown logger {name!r}; choose from {', '.join(TRACKERS)}")
        if name in out:
            continue
        missing = [m for m in MODULES.get(name, ()) if find_spec(m) is None]
        if missing:
            raise TrackerMissing(f"logger {name!r} needs {', '.join(missing)}: pip install {INSTALL[name]}")
        if name == "mlflow" and out_dir is not None:
            mlflow_uri(out_dir)
        if name == "wandb" and os.environ.get("WANDB_MODE", "online") not in WANDB_MODES:  # (read by wandb only
            raise ValueError(f"WANDB_MODE {os.environ['WANDB_MODE']!r:.40}: one of {', '.join(WANDB_MODES)}")  # when
        out.append(name)  # the tracker opened, after a whole evaluation: round 23)
    return out


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict as ``{"a/b": float}``; bools become 0/1, NaN/inf are kept.

    Lists, strings and None are left out (they have no place on a scalar chart).
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


class Tracker(Protocol):
    """What a run tells a tracker. ``step`` is the training step (0 before the first update)."""

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None: ...

    def log_eval(self, when: str, result: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists, tuples) replaced by None: what JSON can hold."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


class JsonlTracker:
    """Appends to ``metrics.jsonl`` (one JSON object per line; flushed and closed per write). A resumed run's file
    whose last line a kill cut short gets its newline first, so that the next line stands on its own."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.is_file() and self.path.stat().st_size:
            with self.path.open("rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def _append(self, obj: dict[str, Any]) -> None:
        with self.path.open("a") as f:  # strict JSON: a NaN/inf (a diverged loss) is written as null
            f.write(json.dumps(finite_or_none(obj), allow_nan=False) + "\n")

    def log_config(self, config: dict[str, Any]) -> None:
        pass  # the run writes config.json itself

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self._append(metrics)

    def log_eval(self, when: str, result: dict[str, Any], step: int) -> None:
        self._append({"eval": when, **result})

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """``torch.utils.tensorboard.SummaryWriter`` writing event files to ``{run_dir}/tensorboard``."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log_config(self, config: dict[str, Any]) -> None:
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in flatten(metrics, "train/").items():
            self.writer.add_scalar(k, v, step)

    def log_eval(self, when: str, result: dict[str, Any], step: int) -> None:
        for k, v in flatten(result, "eval/").items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run (offline unless ``WANDB_MODE`` says otherwise) in ``{run_dir}/wandb``."""

    def __init__(self, run_dir: Path, run_name: str):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "agl"), name=run_name, dir=str(run_dir),
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", disable_git=True,
                                                      x_disable_stats=True, save_code=False,
                                                      x_save_requirements=False))
        self.step = -1

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(json.loads(json.dumps(config, default=str)), allow_val_change=True)

    def _log(self, data: dict[str, float], step: int) -> None:
        # W&B drops rows logged at a step below its last one: an eval at the last step joins that step's row
        self.step = max(self.step, step)
        self.run.log(data, step=self.step)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self._log(flatten(metrics, "train/"), step)

    def log_eval(self, when: str, result: dict[str, Any], step: int) -> None:
        self._log(flatten(result, "eval/"), step)
        self.run.summary.update({f"eval_{when}/{k}": v for k, v in flatten(result).items()})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global active run)."""

    def __init__(self, run_dir: Path, run_name: str):
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir).resolve()
        self.client = MlflowClient(tracking_uri=mlflow_uri(run_dir.parent))
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run_dir.parent.name or "agl"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name,
                                             tags={"agl.run_dir": str(run_dir)}).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = _flat_params(config)
        params = [Param(k, v[:6000]) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _log(self, data: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)  # (MLflow's names: alphanumerics, _ - . space / only: a histogram key of a
        metrics = [Metric(re.sub(r"[^\w\-. /]", "_", k, flags=re.ASCII), v, now, step)  # reward of 2e+06 was
                   for k, v in data.items() if math.isfinite(v)]  # an MlflowException after the whole run; round 23)
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self._log(flatten(metrics, "train/"), step)

    def log_eval(self, when: str, result: dict[str, Any], step: int) -> None:
        self._log(flatten(result, "eval/"), step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, default=str) if not isinstance(v, str) else v
    return out


class Trackers:
    """Every chosen tracker behind one object; ``jsonl`` is always among them (see the module docstring).

    Args:
        names: tracker names (:data:`TRACKERS`); checked with :func:`check_trackers`.
        run_dir: the run's directory (exists).
    Raises:
        ValueError, TrackerMissing: as :func:`check_trackers`.
    """

    def __init__(self, names: Iterable[str], run_dir: Path):
        names = check_trackers(names)
        run_dir = Path(run_dir)
        self.names = ["jsonl"] + [n for n in names if n != "jsonl"]
        self.trackers: list[Tracker] = []
        try:
            for name in self.names:
                if name == "jsonl":
                    self.trackers.append(JsonlTracker(run_dir))
                elif name == "console":  # the run prints its own lines (agl_trainer.loop.step_line)
                    continue
                elif name == "tensorboard":
                    self.trackers.append(TensorBoardTracker(run_dir))
                elif name == "wandb":
                    self.trackers.append(WandbTracker(run_dir, run_dir.name))
                elif name == "mlflow":
                    self.trackers.append(MlflowTracker(run_dir, run_dir.name))
        except BaseException:
            self.close()
            raise

    def log_config(self, config: dict[str, Any]) -> None:
        """Once per run: the run's settings (JSON-ready values)."""
        for t in self.trackers:
            t.log_config(config)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """One training step's metrics dict (``metrics.jsonl``'s line, unchanged)."""
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_eval(self, when: str, result: dict[str, Any], step: int) -> None:
        """One evaluation (``when``: ``before``, ``during``, ``after``) at training step ``step``."""
        for t in self.trackers:
            t.log_eval(when, result, step)

    def close(self) -> None:
        """Flush and close every tracker (each once; errors of one do not stop the others' closing)."""
        errors = []
        for t in self.trackers:
            try:
                t.close()
            except Exception as exc:  # noqa: BLE001 - close the rest, then report
                errors.append(exc)
        self.trackers = []
        if errors:
            raise errors[0]

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
