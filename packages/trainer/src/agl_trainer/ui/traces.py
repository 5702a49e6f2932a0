"""Rollouts, groups and rows as the dashboard shows them, computed from the Store's records.

Rows and merge breaks come from :func:`agl_trainer.algorithm.aggregate.build_rows` run on the rollout's current
attempt with the run's own settings (``aggregation``, ``max_prompt_tokens``, ``max_response_tokens``),
and advantages from :func:`agl_trainer.algorithm.batch.advantages_of` with the run's ``advantage``,
``norm_by_std``, ``advantage_level`` and ``min_group_size`` (each checked against its TrainConfig field:
:func:`checked_settings`), over the same rollouts the trainer keeps
(:func:`agl_trainer.algorithm.batch.select_groups`, then only rollouts that yield a row, as ``build_batch`` does):
the page shows what training used, not a re-implementation of it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
from agl_common.schemas import CallRecord, Rollout, answer_text, first_choice
from agl_common.store import Store
from pydantic import ConfigDict, TypeAdapter, ValidationError

from ..algorithm.aggregate import AggregateStats, Row, Vocabulary, build_rows
from ..algorithm.batch import advantages_of, select_groups
from ..config import TrainConfig

#: TrainConfig fields the views use.
SETTINGS: tuple[str, ...] = ("aggregation", "advantage", "norm_by_std", "advantage_level", "min_group_size",
                             "max_prompt_tokens", "max_response_tokens")
#: Their defaults (TrainConfig's), for a run whose config lacks them or holds a value TrainConfig refuses.
SETTINGS_DEFAULTS: dict[str, Any] = {k: TrainConfig.model_fields[k].get_default(call_default_factory=True)
                                     for k in SETTINGS}
#: Each setting's check: its TrainConfig field's type and constraints (``Literal``, ``ge=1``...).
_CHECKS: dict[str, TypeAdapter] = {
    k: TypeAdapter(TrainConfig.model_fields[k].rebuild_annotation(),
                   config=ConfigDict(allow_inf_nan=TrainConfig.model_config.get("allow_inf_nan", True)))
    for k in SETTINGS}


def _takes_bool(annotation: Any) -> bool:
    return annotation is bool or bool in get_args(annotation)


def checked_settings(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The :data:`SETTINGS` of a run's ``config.json``, each checked against its TrainConfig field as training
    would check it (pydantic's validation of the field's type and constraints; a boolean is no number).

    Returns ``(settings, refused)``: ``settings`` holds every key of :data:`SETTINGS`, the config's value
    (as validated: ``"2"`` reads as 2) or, when absent or refused, the default; ``refused`` maps each setting whose
    value was refused (hand-edited, or written by another AGL version: a newer estimator's name) to a line saying
    what it was, why it was refused and the default used instead (round 18: ``min_group_size: "two"`` or
    ``advantage: "banana"`` made the group and rollout pages a 500). Raises nothing."""
    config = config if isinstance(config, dict) else {}
    settings, refused = dict(SETTINGS_DEFAULTS), {}
    for key in SETTINGS:
        if key not in config:
            continue
        value = config[key]
        try:
            if isinstance(value, bool) and not _takes_bool(TrainConfig.model_fields[key].annotation):
                raise ValueError("a boolean, not a value of this setting")
            settings[key] = _CHECKS[key].validate_python(value)
        except (ValidationError, ValueError) as exc:
            why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) and exc.errors() else str(exc)
            refused[key] = f"was {_short(value)} ({why}): the default {SETTINGS_DEFAULTS[key]!r} is used"
    return settings, refused


def _short(value: Any, chars: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[:chars] + "…"


def run_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The :data:`SETTINGS` of a run's ``config.json`` (:func:`checked_settings`: a value TrainConfig refuses, or
    an absent one, gives the default)."""
    return checked_settings(config)[0]


def load_decoder(tokenizer: str | None) -> Vocabulary:
    """The :class:`~agl_trainer.algorithm.aggregate.Vocabulary` of a tokenizer directory (or a model's), or of the
    base model's cached copy when ``tokenizer`` is None and it exists, or an empty one (``"none"``, or nothing
    cached: ids are shown as numbers). Raises ``FileNotFoundError`` (no tokenizer in a named directory) and
    ``ValueError`` (one that cannot be loaded)."""
    from ..model import DEFAULT_CACHE

    if tokenizer == "none":
        return Vocabulary()
    path = Path(tokenizer) if tokenizer else DEFAULT_CACHE / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        if tokenizer:
            raise FileNotFoundError(f"no tokenizer in {path}")
        return Vocabulary()
    from ..model import load_vocabulary

    return load_vocabulary(path)  # (ModelFilesError, a ValueError: one line)


@dataclass
class Trace:
    """One rollout analysed: every recorded call (all attempts), the current attempt's rows, and each
    merge break attached to the row it started (``breaks[k]``: the break before row ``k``, or absent)."""

    rollout: Rollout
    calls: list[CallRecord]
    rows: list[Row]
    stats: AggregateStats
    breaks: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: (attempt_id, seq) of a call → index of the row it went into
    row_of_call: dict[tuple[str, int], int] = field(default_factory=dict)


def analyse(rollout: Rollout, calls: list[CallRecord], settings: dict[str, Any], decoder: Vocabulary) -> Trace:
    """Build the rows of ``rollout``'s current attempt as training does, and place every merge break.

    Every break is kept (not only the metrics' first few per class), with 16 tokens either side of its
    diverging offset. Cost: that of :func:`build_rows`, O(tokens of the attempt's calls).
    """
    stats = AggregateStats(max_examples=10**9, example_context_tokens=16)
    current = [c for c in calls if c.attempt_id == rollout.attempt_id]
    rows = build_rows(current, settings["aggregation"], stats, vocab=decoder,
                      max_prompt_tokens=settings["max_prompt_tokens"],
                      max_response_tokens=settings["max_response_tokens"])
    first_call = {row.seqs[0]: k for k, row in enumerate(rows) if row.seqs}
    trace = Trace(rollout=rollout, calls=calls, rows=rows, stats=stats)
    for cls, examples in stats.merge_break_examples.items():
        for ex in examples:
            k = first_call.get(ex["seq"])
            if k is not None:
                trace.breaks[k] = {**ex, "class": cls}
    for k, row in enumerate(rows):
        for s in row.seqs:
            trace.row_of_call[(rollout.attempt_id, s)] = k
    return trace


@dataclass(frozen=True)
class TraceSummary:
    """What the group and step pages need of a rollout's trace: counts only (a few bytes, cached by thousands)."""

    calls: int
    rows: int
    merge_breaks: int


class TraceCache:
    """Analysed rollouts, rebuilt only when the rollout's record or its number of calls changed.

    Keeps the ``size`` most recently used traces (a 32k-token trace is tens of MB of Python lists) and the
    :class:`TraceSummary` of up to ``summaries`` rollouts, so that a step page of many groups stays cached.
    """

    def __init__(self, store: Store, decoder: Vocabulary, size: int = 32, summaries: int = 20_000):
        self.store, self.decoder, self.size, self.max_summaries = store, decoder, size, summaries
        self._items: OrderedDict[tuple, Trace] = OrderedDict()
        self._summaries: OrderedDict[tuple, TraceSummary] = OrderedDict()

    async def _key(self, rollout: Rollout, settings: dict[str, Any]) -> tuple:
        n = await self.store.call_entries(rollout.rollout_id)
        return rollout.rollout_id, rollout.model_dump_json(), n, tuple(sorted(settings.items()))

    @staticmethod
    def _remember(cache: OrderedDict, key: tuple, value: Any, size: int) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > size:
            cache.popitem(last=False)

    async def get(self, rollout: Rollout, settings: dict[str, Any]) -> Trace:
        """The :class:`Trace` of ``rollout`` (one XLEN round trip when cached, else the whole stream)."""
        key = await self._key(rollout, settings)
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        trace = analyse(rollout, await self.store.read_calls(rollout.rollout_id), settings, self.decoder)
        self._remember(self._items, key, trace, self.size)
        self._remember(self._summaries, key, TraceSummary(len(trace.calls), len(trace.rows), trace.stats.merge_breaks),
                       self.max_summaries)
        return trace

    async def summary(self, rollout: Rollout, settings: dict[str, Any]) -> TraceSummary:
        """The :class:`TraceSummary` of ``rollout`` (analysing it once if it is not cached)."""
        key = await self._key(rollout, settings)
        hit = self._summaries.get(key)
        if hit is not None:
            self._summaries.move_to_end(key)
            return hit
        await self.get(rollout, settings)
        return self._summaries[key]


def group_view(rollouts: list[Rollout], traces: dict[str, TraceSummary], settings: dict[str, Any]) -> dict[str, Any]:
    """One GRPO group as the trainer saw it.

    Returns ``{"advantages": {rollout_id: float}, "signal": str, "kept": int}``: the advantage of each
    rollout that took part (kept by ``select_groups`` and yielding a row; others have none), and the
    group's verdict: ``signal``, ``equal rewards`` (no advantage signal: skipped by the update),
    ``dropped`` (fewer than ``min_group_size`` succeeded) or ``pending`` (rollouts unfinished).
    """
    if any(r.status.value in ("queuing", "running") for r in rollouts):
        return {"advantages": {}, "signal": "pending", "kept": 0}
    kept, _ = select_groups(rollouts, int(settings["min_group_size"]))
    kept = [r for r in kept if traces.get(r.rollout_id) is not None and traces[r.rollout_id].rows > 0]
    if not kept:
        return {"advantages": {}, "signal": "dropped", "kept": 0}
    n_rows = torch.tensor([traces[r.rollout_id].rows for r in kept])
    adv = advantages_of(kept, n_rows.tolist(), settings["advantage"], settings["advantage_level"],
                        bool(settings["norm_by_std"]))
    # every row of a rollout gets the same value at either level: its first row's stands for the rollout
    first = (torch.cumsum(n_rows, 0) - n_rows).tolist()
    advantages = {r.rollout_id: float(adv[i]) for r, i in zip(kept, first)}
    signal = "signal" if any(abs(a) > 0 for a in advantages.values()) else "equal rewards"
    return {"advantages": advantages, "signal": signal, "kept": len(kept)}


def logprob_colour(lp: float) -> str:
    """CSS background for a sampled token of logprob ``lp`` (nats): hue 0 (red, p → 0) to 120 (green, p = 1)."""
    p = math.exp(max(-30.0, min(0.0, lp)))
    return f"hsl({round(120 * p)},75%,82%)"


def message_text(call: CallRecord) -> str:
    """What the model answered in ``call`` (:func:`agl_common.schemas.answer_text`, plus a chat answer's tool
    calls), for the calls table; the error for a failed call. Always a ``str``."""
    if call.status != "ok":
        return call.error or ""
    text = answer_text(call)
    msg = first_choice(call).get("message")
    calls = msg.get("tool_calls") if isinstance(msg, dict) else None
    for tc in calls if isinstance(calls, list) else []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict):
            text += f"\n[tool call] {fn.get('name')}({fn.get('arguments')})"
    return text


#: The events a rollout's page and ``rollouts show`` list: the last this many (a harness may post 1000 an attempt).
EVENTS_SHOWN = 50


def event_lines(events: list[dict[str, Any]], data_chars: int = 300) -> list[dict[str, str]]:
    """The last :data:`EVENTS_SHOWN` of a rollout's harness events (``Store.read_events``) as text: ``attempt``,
    ``type``, ``time`` (UTC, ISO 8601, seconds) and ``data`` (compact JSON, cut to ``data_chars`` characters).
    Whatever a harness posted, every value is a ``str`` (escaping is the page's or the terminal's job)."""
    import datetime
    import json

    out = []
    for e in events[-EVENTS_SHOWN:]:
        t = e.get("t")
        when = (datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")
                if isinstance(t, int | float) and 0 <= t < 1e11 else "-")
        data = json.dumps(e.get("data"), separators=(",", ":"), ensure_ascii=False)
        out.append({"attempt": str(e.get("attempt_id")), "type": str(e.get("type")), "time": when,
                    "data": data if len(data) <= data_chars else data[:data_chars] + "…"})
    return out

