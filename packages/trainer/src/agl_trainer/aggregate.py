"""Recorded calls → training rows, from the recorded token ids only (never re-tokenized).

Two modes:

- ``transition``: each call is its own row (prompt = the call's prompt ids, response = its response ids).
- ``trajectory``: consecutive calls of one attempt are merged while the next call's prompt starts with
  *exactly* the current row's full sequence (prompt + everything after it). Tokens of the next prompt
  beyond that prefix (the chat template's newline, a new user turn, a tool result) are context: in the
  row with response mask 0. Anything else starts a new row, and the break is counted.

A row's ``response_ids`` is everything after its first prompt, ``response_mask`` marks the tokens the
policy sampled (1) versus context (0), and ``old_logprobs`` holds the engine's logprob of each sampled
token (0.0 at mask-0 positions). All three have the same length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from agl_common.schemas import CallRecord


@dataclass
class Row:
    """One training sequence. Lengths in tokens; ``old_logprobs`` in nats."""

    rollout_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    has_logprobs: bool = True
    n_calls: int = 0
    model_version: int = 0

    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append_response(self, call: CallRecord) -> None:
        self.response_ids += call.response_token_ids
        self.response_mask += [1] * len(call.response_token_ids)
        if call.response_logprobs is None:
            self.has_logprobs = False
            self.old_logprobs += [0.0] * len(call.response_token_ids)
        else:
            self.old_logprobs += call.response_logprobs
        self.n_calls += 1
        self.model_version = min(self.model_version, call.model_version) if self.n_calls > 1 else call.model_version


@dataclass
class AggregateStats:
    """Counts of one aggregation, for the per-step metrics."""

    calls: int = 0
    rows: int = 0
    merge_breaks: int = 0
    skipped_calls: Counter = field(default_factory=Counter)


def _usable(call: CallRecord, stats: AggregateStats) -> bool:
    if call.status != "ok":
        stats.skipped_calls["error"] += 1
        return False
    if not call.prompt_token_ids or not call.response_token_ids:
        stats.skipped_calls["no_token_ids"] += 1
        return False
    return True


def build_rows(calls: list[CallRecord], mode: str = "trajectory",
               stats: AggregateStats | None = None) -> list[Row]:
    """Rows of one rollout attempt's calls (ordered by ``seq``).

    Args:
        calls: the attempt's recorded calls; failed calls and calls without token ids are skipped.
        mode: ``"trajectory"`` (merge by exact token prefix) or ``"transition"`` (one row per call).
        stats: counters to add to (calls, rows, merge breaks, skipped calls by reason).
    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in ("trajectory", "transition"):
        raise ValueError(f"unknown aggregation mode {mode!r}")
    stats = stats if stats is not None else AggregateStats()
    rows: list[Row] = []
    current: Row | None = None
    for call in sorted(calls, key=lambda c: c.seq):
        stats.calls += 1
        if not _usable(call, stats):
            continue
        if mode == "trajectory" and current is not None:
            seq = current.full_ids()
            prompt = call.prompt_token_ids
            if len(prompt) >= len(seq) and prompt[: len(seq)] == seq:
                context = prompt[len(seq):]
                current.response_ids += context
                current.response_mask += [0] * len(context)
                current.old_logprobs += [0.0] * len(context)
                current.append_response(call)
                continue
            stats.merge_breaks += 1
        current = Row(rollout_id=call.rollout_id, prompt_ids=list(call.prompt_token_ids))
        current.append_response(call)
        rows.append(current)
    stats.rows += len(rows)
    return rows
