"""Run directories as the dashboard reads them: config, per-step metrics, evaluations, summary, status.

A run is a directory holding ``config.json`` or ``metrics.jsonl`` (``runs/<name>/<run-id>/``); it is
named by its directory name (the run id, also the prefix of its rollout ids). Every field is read
defensively: older runs lack some (``time_generation_s`` was ``rollout_s``, ``heldout_before`` was
``accuracy_before``...), and a run still training has a half-written last line.

A long run is tens of MB of metrics (100,000 steps: 24 MB, a second or more to parse): :class:`RunCache` keeps
each run read until one of its files changes (mtime, size), the server reads it in a worker thread, and the run
page gets a bounded view of it: the last :data:`STEPS_SHOWN` steps in its table and at most :data:`MAX_POINTS`
points a curve (:meth:`Run.to_json`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_common.schemas import MAX_JSON_DEPTH, too_deep
from agl_common.settings import redacted_text

from ..files import read_jsonl as files_read_jsonl
from ..files import read_small_file

#: A run whose ``metrics.jsonl`` changed this recently (seconds) and that has no summary is "running".
RUNNING_WINDOW_S = 300

#: Per-step series drawn on the run page: (title, [(label, candidate keys, first present wins)]).
CHARTS: list[tuple[str, list[tuple[str, tuple[str, ...]]]]] = [
    ("reward and accuracy", [("reward mean", ("reward_mean",)), ("accuracy", ("accuracy",))]),
    ("loss", [("loss", ("loss",))]),
    ("policy entropy (nats/token)", [("entropy", ("entropy",))]),
    ("KL and ratio", [("kl", ("kl", "kl_mean")), ("ratio mean", ("ratio_mean",)), ("clip frac", ("clip_frac",))]),
    ("rows, merge breaks, failed rollouts", [("rows", ("rows",)), ("merge breaks", ("merge_breaks",)),
                                             ("failed", ("failed",))]),
    ("step time split (s)", [("generation", ("time_generation_s", "rollout_s")), ("waiting", ("time_wait_s",)),
                             ("update", ("time_update_s",)), ("weight load", ("time_weight_load_s",)),
                             ("pause-drain", ("time_pause_drain_s", "drain_s")), ("step", ("step_s",))]),
]

#: Per-role charts of a run with roles (a policy per sub-agent): (title, key in each step's ``roles[role]``),
#: one series per role.
ROLE_CHARTS: list[tuple[str, str]] = [("reward per role (rollouts that called it)", "reward_mean"),
                                      ("loss per role", "loss"), ("entropy per role (nats/token)", "entropy"),
                                      ("rows per role", "rows")]

#: Columns of the run page's step table: (title, candidate keys).
STEP_COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("step", ("step",)), ("policy", ("policy_version",)), ("reward", ("reward_mean",)), ("acc", ("accuracy",)),
    ("loss", ("loss",)), ("kl", ("kl", "kl_mean")), ("entropy", ("entropy",)),
    ("rows", ("rows",)), ("breaks", ("merge_breaks",)),
    ("failed", ("failed",)), ("groups", ("groups",)), ("step s", ("step_s",)),
]


#: Steps in the run page's step table (and the ``table`` of ``/api/runs/{run}``): the last this many; every step
#: keeps its page (``/runs/{run}/steps/{step}``).
STEPS_SHOWN = 500
#: Most points a curve of the run page has: a longer run's steps are taken in buckets of consecutive steps, each
#: point the mean of its bucket, drawn at the bucket's last step.
MAX_POINTS = 2000
#: Evaluation lines the run page lists: the last this many.
EVALS_SHOWN = 200


def pick(d: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first of ``keys`` present (and not None) in ``d``, else None."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def step_groups(m: dict[str, Any]) -> list[str]:
    """The group ids a step's metrics line names (``groups``): its string entries; anything else (a hand-edited
    or foreign ``metrics.jsonl``: a number, a dict, a string in place of the list) names none."""
    groups = m.get("groups")
    return [g for g in groups if isinstance(g, str)] if isinstance(groups, list) else []


#: Largest run file the dashboard reads (bytes); a larger one reads as missing.
MAX_RUN_FILE_BYTES = 64 * 2**20
#: Largest integer a run file's number may be (beyond: read as None: a float of it would overflow).
MAX_INT = 2**63


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _bounded_int(text: str) -> int | None:
    value = int(text)
    return value if abs(value) <= MAX_INT else None


def _loads(text: str) -> Any:
    """JSON with ``NaN``/``Infinity`` (written by older runs), floats past float range (``1e400``) and integers past
    :data:`MAX_INT` read as None, so every page and API answer is valid JSON and every number converts to a float.
    Raises ``ValueError``, also for JSON nested deeper than :data:`~agl_common.schemas.MAX_JSON_DEPTH` (round
    15: a ``config.json`` of 100,000 nested lists was a ``RecursionError`` in the parser, and every page that lists
    runs answered 500)."""
    try:
        obj = json.loads(text, parse_constant=lambda _: None, parse_float=_finite, parse_int=_bounded_int)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    if isinstance(obj, (dict, list)) and too_deep(obj):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH}")
    return obj


def read_text(path: Path) -> str | None:
    """The text of ``path`` if it is a regular file of at most :data:`MAX_RUN_FILE_BYTES`, else None: a FIFO (whose
    open would block the dashboard's event loop for good), a device (``/dev/zero``), a directory, a file too large
    or one that cannot be read count as missing (:func:`~agl_trainer.files.read_small_file`). Undecodable bytes
    are replaced."""
    try:
        return read_small_file(path, MAX_RUN_FILE_BYTES).decode("utf-8", errors="replace")
    except ValueError:
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON objects of a JSON Lines file (:func:`agl_trainer.files.read_jsonl` with :func:`_loads`, as a resume reads
    ``metrics.jsonl``); a line that does not parse (a half-written last line) is skipped; a file that is not a
    regular one of at most :data:`MAX_RUN_FILE_BYTES` counts as empty."""
    try:
        return files_read_jsonl(path, MAX_RUN_FILE_BYTES, _loads)
    except ValueError:
        return []


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = _loads(read_text(path) or "")
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


#: Config keys whose values are secrets wherever they appear (shown as ``***``).
_SECRET_KEY = re.compile(r"(?i)(password|passwd|secret|token|api_?key|^key$|_key$)")


def shown_config(obj: Any, key: str = "") -> Any:
    """A run's ``config.json`` as the dashboard shows it: values under a secret-looking key replaced by ``***``,
    and a password inside any URL in a string hidden (:func:`agl_common.settings.redacted_text`). The trainer writes
    its config redacted already; a hand-written or copied one is not shown in the clear either."""
    if isinstance(obj, dict):
        return {k: shown_config(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shown_config(v, key) for v in obj]
    if isinstance(obj, str):
        if obj and _SECRET_KEY.search(key):
            return "***"
        if "://" in obj:  # each URL inside the text (a harness command's --base), the rest as written
            return redacted_text(obj)
    return obj


@dataclass
class Run:
    """One run directory, read once. ``steps``: the metrics lines with a ``step`` (and no ``eval``),
    in file order; ``evals``: the evaluation lines (``eval``: before / during / after)."""

    run_id: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    mtime: float = 0.0
    #: Names the state of the run's files (:func:`run_signature`): a poll that names it gets "unchanged".
    version: str = ""
    #: The bounded views, computed once (a run read is never changed: a change of its files reads a new one).
    _views: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        """The run's name: its parent directory (``demo`` for ``runs/demo/<run-id>``)."""
        return self.path.parent.name

    @property
    def status(self) -> str:
        """``finished`` (a summary exists), ``running`` (metrics changed in the last
        :data:`RUNNING_WINDOW_S` seconds) or ``stopped`` (neither: killed, or waiting on its first step)."""
        if self.summary is not None:
            return "finished"
        return "running" if time.time() - self.mtime < RUNNING_WINDOW_S else "stopped"

    def eval_accuracy(self, when: str) -> float | None:
        """Held-out accuracy ``before`` or ``after`` training (fraction): the summary's ``heldout_{when}``
        (or older ``accuracy_{when}``), else the last eval line of that kind."""
        if self.summary:
            v = _num(pick(self.summary, (f"heldout_{when}", f"accuracy_{when}")))
            if v is not None:
                return v
        lines = [e for e in self.evals if (e.get("eval") or e.get("when")) == when]
        return _num(lines[-1].get("accuracy")) if lines else None

    def step(self, number: int) -> dict[str, Any] | None:
        """The last metrics line of step ``number`` (a resumed run may repeat one), or None."""
        found = [m for m in self.steps if m.get("step") == number]
        return found[-1] if found else None

    def points_every(self, max_points: int = MAX_POINTS) -> int:
        """How many consecutive steps one point of a curve stands for: 1 up to ``max_points`` steps."""
        return max(1, math.ceil(len(self.steps) / max(1, max_points)))

    def series(self, max_points: int = MAX_POINTS) -> list[dict[str, Any]]:
        """The :data:`CHARTS` data: per chart its title, the step numbers and one list per series (None where a
        step lacks the field). A run of more than ``max_points`` steps gets ``max_points`` points at most: each
        the mean of :meth:`points_every` consecutive steps' values (None if none has one), at the last of them."""
        k = self.points_every(max_points)
        spans = [(lo, min(lo + k, len(self.steps))) for lo in range(0, len(self.steps), k)]
        xs = [self.steps[hi - 1].get("step") for _, hi in spans]

        def points(values: list[float | None]) -> list[float | None]:
            return values if k == 1 else [_mean(values[lo:hi]) for lo, hi in spans]

        charts = [{"title": title, "x": xs,
                   "series": [{"label": label, "values": points([_num(pick(m, keys)) for m in self.steps])}
                              for label, keys in series]}
                  for title, series in CHARTS]
        roles = sorted({r for m in self.steps if isinstance(m.get("roles"), dict) for r in m["roles"]})
        if roles:  # :data:`ROLE_CHARTS`, one series per role
            charts += [{"title": title, "x": xs,
                        "series": [{"label": role,
                                    "values": points([_num(_role_value(m, role, key)) for m in self.steps])}
                                   for role in roles]}
                       for title, key in ROLE_CHARTS]
        return charts

    def table(self, limit: int | None = STEPS_SHOWN) -> list[list[str]]:
        """The step table's cells (strings), one list per step, columns as :data:`STEP_COLUMNS`: the last
        ``limit`` steps (None: every step)."""
        shown = self.steps if limit is None else self.steps[max(0, len(self.steps) - limit):]
        return [[_cell(pick(m, keys)) for _, keys in STEP_COLUMNS] for m in shown]

    def evals_shown(self) -> list[dict[str, Any]]:
        """The evaluation lines the run page lists: the last :data:`EVALS_SHOWN`."""
        return self.evals[-EVALS_SHOWN:]

    def to_json(self) -> dict[str, Any]:
        """What the run page polls (``/api/runs/{run_id}``), of a bounded size whatever the run's length: ``table``
        (and ``step_numbers``) the last :data:`STEPS_SHOWN` steps, ``table_hidden`` the number of earlier ones,
        ``charts`` at most :data:`MAX_POINTS` points a series, each the mean of ``points_every`` steps. The
        charts and the table are computed once per run read (the status, which moves with the clock, each call)."""
        if "charts" not in self._views:  # (two threads may both compute it: the same values)
            table = self.table()
            shown = self.steps[len(self.steps) - len(table):]
            self._views.update(table=table, step_numbers=[m.get("step") for m in shown],
                               points_every=self.points_every(), charts=self.series())
        v = self._views
        return {"run_id": self.run_id, "status": self.status, "version": self.version, "steps": len(self.steps),
                "step_numbers": v["step_numbers"], "table_hidden": len(self.steps) - len(v["table"]),
                "points_every": v["points_every"],
                "before": self.eval_accuracy("before"), "after": self.eval_accuracy("after"),
                "charts": v["charts"], "table": v["table"]}


def _mean(values: list[float | None]) -> float | None:
    """The mean of the numbers among ``values`` (None if there are none, or if it is not finite)."""
    nums = [v for v in values if v is not None]
    if not nums:
        return None
    mean = sum(v / len(nums) for v in nums)  # (divided first: a sum of large values would overflow)
    return mean if math.isfinite(mean) else None


def _role_value(m: dict[str, Any], role: str, key: str) -> Any:
    roles = m.get("roles")
    stats = roles.get(role) if isinstance(roles, dict) else None
    return stats.get(key) if isinstance(stats, dict) else None


def _num(v: Any) -> float | None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        value = float(v)
    except OverflowError:  # (an int too large for a float)
        return None
    return value if math.isfinite(value) else None


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return str(len(v))
    return str(v)


def run_signature(path: Path) -> tuple:
    """The state of a run directory's files: ``(mtime_ns, size, inode)`` of ``metrics.jsonl``, ``config.json`` and
    ``summary.json`` (None for one that cannot be read). Equal signatures: the same content, as far as
    :class:`RunCache` can tell without reading it. Raises nothing (``stat`` only: a FIFO is not opened)."""
    out = []
    for name in ("metrics.jsonl", "config.json", "summary.json"):
        try:
            st = (path / name).stat()
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def load_run(path: Path) -> Run:
    """Read one run directory (missing files give empty fields, never an error)."""
    version = hashlib.sha1(repr(run_signature(path)).encode()).hexdigest()[:16]  # (before reading: never newer)
    metrics = path / "metrics.jsonl"
    lines = read_jsonl(metrics)
    mtimes = [t for p in (metrics, path / "config.json", path / "summary.json") if (t := _mtime(p)) is not None]
    return Run(run_id=path.name, path=path, config=shown_config(_read_json(path / "config.json") or {}),
               summary=shown_config(_read_json(path / "summary.json")),  # (a copied or hand-edited one too)
               steps=[m for m in lines if "step" in m and "eval" not in m and "when" not in m],
               evals=[m for m in lines if "eval" in m or "when" in m], mtime=max(mtimes, default=0.0),
               version=version)


def _file_bytes(signature: tuple) -> int:
    """The bytes of a run's files, from its :func:`run_signature`."""
    return sum(entry[1] for entry in signature if entry is not None)


class RunCache:
    """Runs read (:func:`load_run`), each kept until one of its files changes (:func:`run_signature`): a poll of
    an unchanged run reads nothing (a 100,000-step run was parsed anew, seconds of CPU, on every 2 s poll).

    Keeps the ``size`` most recently used runs, and fewer when together they hold more than ``max_steps`` metrics
    lines or their files more than ``max_bytes`` (parsed, a file takes several times its size: four 17 MiB files of
    a few long lines held ~550 MiB; the most recent run is always kept). Thread-safe: a run is read by one thread
    at a time; a second asking for it meanwhile waits for that read. Meant to be called from worker threads (it
    reads files)."""

    def __init__(self, size: int = 32, max_steps: int = 500_000, max_bytes: int = 64 * 2**20):
        self.size, self.max_steps, self.max_bytes = size, max_steps, max_bytes
        self._items: OrderedDict[Path, tuple[tuple, Run]] = OrderedDict()
        self._lock = threading.Lock()
        self._reading: dict[Path, threading.Lock] = {}

    def _hit(self, path: Path, signature: tuple) -> Run | None:
        with self._lock:
            hit = self._items.get(path)
            if hit is None or hit[0] != signature:
                return None
            self._items.move_to_end(path)
            return hit[1]

    def get(self, path: Path) -> Run:
        """The run in ``path``, read again only if its files changed since it was last read. Raises nothing that
        :func:`load_run` does not."""
        run = self._hit(path, run_signature(path))
        if run is not None:
            return run
        with self._lock:
            reading = self._reading.setdefault(path, threading.Lock())
        with reading:
            signature = run_signature(path)  # (taken before the read: a change during it reads again next time)
            run = self._hit(path, signature)
            if run is not None:  # read by the thread this one waited for
                return run
            run = load_run(path)
            with self._lock:
                self._items[path] = (signature, run)
                self._items.move_to_end(path)
                while len(self._items) > 1 and (len(self._items) > self.size or sum(
                        len(r.steps) + len(r.evals) for _, r in self._items.values()) > self.max_steps or sum(
                        _file_bytes(sig) for sig, _ in self._items.values()) > self.max_bytes):
                    self._items.popitem(last=False)
            return run


def find_runs(runs_dir: Path) -> list[Path]:
    """Run directories under ``runs_dir`` (it, its children and grandchildren holding ``config.json`` or
    ``metrics.jsonl``), newest first. A missing ``runs_dir`` has none; a directory whose name is not text (bytes
    that are not UTF-8: no URL or page can name it), or whose files this process may not read, is left out."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    candidates = [runs_dir, *runs_dir.glob("*/"), *runs_dir.glob("*/*/")]
    found = {}
    for p in candidates:
        times = [t for q in (p / "metrics.jsonl", p / "config.json") if (t := _mtime(q)) is not None]
        if _is_text(p.name) and times:
            found[p] = max(times)
    return sorted(found, key=found.__getitem__, reverse=True)


def _mtime(path: Path) -> float | None:
    """The modification time of ``path`` (seconds since the epoch), None if it cannot be read: missing, or in a
    folder this process may not enter or list (its ``stat`` raised ``PermissionError``: a 500 for the whole
    dashboard once)."""
    try:
        return path.stat().st_mtime if os.access(path, os.R_OK) else None
    except OSError:
        return None


def _is_text(name: str) -> bool:
    """``name`` holds no undecodable bytes (Python maps them to lone surrogates, which no page can write)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_run(runs_dir: Path, run_id: str, cache: RunCache | None = None) -> Run | None:
    """The run whose directory is named ``run_id`` (read through ``cache`` when given), or None."""
    for p in find_runs(runs_dir):
        if p.name == run_id:
            return cache.get(p) if cache is not None else load_run(p)
    return None
