"""Recorded calls → training rows, from the recorded token ids only (never re-tokenized).

Two modes:

- ``transition``: each call is its own row (prompt = the call's prompt ids, response = its response ids).
- ``trajectory``: consecutive calls of one attempt are merged while the next call's prompt starts with
  *exactly* the current row's full sequence (prompt + everything after it). Tokens of the next prompt
  beyond that prefix (the chat template's newline, a new user turn, a tool result) are context: in the
  row with response mask 0. Anything else starts a new row, and the break is counted and classified.

A row's ``response_ids`` is everything after its first prompt, ``response_mask`` marks the tokens the
policy sampled (1) versus context (0), and ``old_logprobs`` holds the engine's logprob of each sampled
token (0.0 at mask-0 positions). All three have the same length.

Merge breaks (trajectory mode) are classified, first match wins (``S`` = the current row's full
sequence, ``P`` = the next call's prompt ids, ``d`` = the first index where they differ):

- ``role_change``: the next call was made by another role (:attr:`CallRecord.role`: a sub-agent with its own
  policy): rows never mix roles, whatever the ids, since each role's rows train its own adapter.
- ``missing_stop_token``: only with the vocabulary's ``eos_ids``. ``P`` does extend ``S`` exactly, but the row's
  last call finished with ``finish_reason`` ``"stop"`` or ``"tool_calls"`` and its response ids do not end
  with an end-of-turn/eos id: the engine stopped on a token (or stop string) that is not in the recorded
  ids, and the template's ``<|im_end|>`` in ``P`` would silently become context. The merge is refused.
  (A ``"length"`` finish legitimately lacks the stop token: the template closes the cut turn; it merges.)
- ``retokenized``: same text, different ids: ``decode(S)`` is a prefix of ``decode(P)`` (typically the
  sampled ids were a non-canonical tokenization of their text and the template re-tokenized it).
- ``template_rerender``: the mismatch begins inside the span of the row's last response
  (``d >= response start``, ``d < len(P)``) and the texts differ: the harness sent the assistant turn
  back re-rendered (a parsed tool call re-serialized with other spacing, stripped whitespace...).
- ``other``: anything else (history edited before the last response, a prompt shorter than ``S``...).

Without a vocabulary's ``decode``, ``retokenized`` and ``template_rerender`` cannot be told apart from
each other or from anything else, so those breaks are all ``other``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from agl_common.schemas import CallRecord, record_fault, sampling_not_plain

#: Merge-break classes, in the order they are tested (see the module docstring).
BREAK_CLASSES = ("role_change", "missing_stop_token", "retokenized", "template_rerender", "other")
#: ``finish_reason`` values meaning the engine stopped on a stop token or string (not on ``max_tokens``).
STOP_FINISH_REASONS = frozenset({"stop", "tool_calls"})


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
    #: ``seq`` of each call merged into the row, in order (``seqs[0]`` is the call that started it)
    seqs: list[int] = field(default_factory=list)
    #: the role whose calls the row holds (:attr:`CallRecord.role`; None without roles)
    role: str | None = None

    def full_ids(self) -> list[int]:
        """``prompt_ids + response_ids`` (a new list)."""
        return self.prompt_ids + self.response_ids

    def append_context(self, ids: list[int]) -> None:
        """Append tokens the policy did not sample (mask 0, logprob 0.0)."""
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.old_logprobs += [0.0] * len(ids)

    def append_response(self, call: CallRecord) -> None:
        """Append ``call``'s sampled tokens (mask 1) and logprobs; a call without logprobs adds 0.0s."""
        self.response_ids += call.response_token_ids
        self.response_mask += [1] * len(call.response_token_ids)
        if call.response_logprobs is None:
            self.has_logprobs = False
            self.old_logprobs += [0.0] * len(call.response_token_ids)
        else:
            self.old_logprobs += call.response_logprobs
        self.n_calls += 1
        self.seqs.append(call.seq)
        self.model_version = min(self.model_version, call.model_version) if self.n_calls > 1 else call.model_version

    def truncate_response(self, n: int) -> int:
        """Keep the first ``n`` response tokens (ids, mask, logprobs); returns how many were cut."""
        cut = max(0, len(self.response_ids) - n)
        if cut:
            del self.response_ids[n:], self.response_mask[n:], self.old_logprobs[n:]
        return cut


@dataclass
class AggregateStats:
    """Counts of one or more aggregations (one training step's), for the per-step metrics.

    ``merge_break_examples`` keeps, per class, up to ``max_examples`` dicts (JSON-ready) describing a
    break: ``rollout_id``, ``attempt_id``, ``seq`` (the call whose prompt broke the merge), ``position``
    (``d``, the first differing token index), ``row_tokens`` (``len(S)``), ``prompt_tokens``
    (``len(P)``), ``response_start`` (where the row's last response began in ``S``), ``row_ids`` /
    ``prompt_ids`` (``example_context_tokens`` tokens each side of ``d``), and ``row_text`` /
    ``prompt_text`` (those ids decoded; ``None`` without a decoder).
    """

    calls: int = 0
    rows: int = 0
    merge_breaks: int = 0
    skipped_calls: Counter = field(default_factory=Counter)
    merge_break_classes: Counter = field(default_factory=Counter)
    merge_break_examples: dict[str, list[dict]] = field(default_factory=dict)
    #: rows not emitted, by reason (``prompt_too_long``), and the calls they held
    dropped_rows: Counter = field(default_factory=Counter)
    dropped_calls: int = 0
    #: rows whose response was cut to ``max_response_tokens``, and the tokens cut (sampled + context)
    truncated_rows: int = 0
    truncated_tokens: int = 0
    max_examples: int = 3
    example_context_tokens: int = 4

    def metrics(self) -> dict:
        """The counters added by the limits and the break classification, as JSON-ready values."""
        return {"merge_break_classes": dict(self.merge_break_classes),
                "merge_break_examples": {k: list(v) for k, v in self.merge_break_examples.items()},
                "skipped_calls": dict(self.skipped_calls), "dropped_rows": dict(self.dropped_rows),
                "dropped_calls": self.dropped_calls, "truncated_rows": self.truncated_rows,
                "truncated_tokens": self.truncated_tokens}


def _usable(call: CallRecord, stats: AggregateStats, vocab: Vocabulary) -> bool:
    if call.status != "ok":
        stats.skipped_calls["error"] += 1
        return False
    if record_fault(call):  # (the rule a record is written under, read again: one edited in Redis, more ids than
        stats.skipped_calls["record_fault"] += 1  # logprobs, was exported and trained as it was; round 23)
        return False
    if sampling_not_plain(call.request):  # its logprobs are not its sampling distribution's: off-policy data
        stats.skipped_calls["sampling_not_plain"] += 1
        return False
    if not call.prompt_token_ids or not call.response_token_ids:
        stats.skipped_calls["no_token_ids"] += 1
        return False
    if vocab.outside(call.prompt_token_ids) or vocab.outside(call.response_token_ids):
        stats.skipped_calls["token_id_outside_vocabulary"] += 1
        return False
    return True


@dataclass(frozen=True)
class Vocabulary:
    """What rows are built with from the trained model's tokenizer (:func:`agl_trainer.model.load_vocabulary`).

    ``decode``: token ids → text (``tokenizer.decode``), to classify merge breaks and show tokens; ``eos_ids``:
    end-of-turn/eos ids for the ``missing_stop_token`` check (:func:`agl_trainer.model.end_of_turn_ids`);
    ``size``: the number of token ids the model embeds (ids ``0 .. size - 1``): a call holding an id past it
    (an engine serving another model) is skipped as ``token_id_outside_vocabulary``, never handed to an update
    where it would be an ``IndexError``. Each field None: not known (no decoding, no stop-token check, no bound).
    """

    decode: Callable[[list[int]], str] | None = None
    eos_ids: frozenset[int] | None = None
    size: int | None = None

    def text(self, ids: list[int]) -> str | None:
        """``decode(ids)``, or None without a decoder or if it raises (an id the tokenizer lacks must not break a
        page or a metric)."""
        return _safe_decode(self.decode, list(ids))

    def piece(self, token_id: int) -> str:
        """One token's text (its id in brackets without a decoder)."""
        t = self.text([token_id])
        return f"[{token_id}]" if t is None else t

    def outside(self, ids: list[int]) -> bool:
        """Whether any of ``ids`` is past :attr:`size` (False when the size is not known)."""
        return self.size is not None and bool(ids) and max(ids) >= self.size


def first_difference(a: list[int], b: list[int], chunk: int = 256) -> int:
    """Index of the first position where ``a`` and ``b`` differ; ``min(len(a), len(b))`` if one is a
    prefix of the other. Compares ``chunk``-long slices first (C speed), then scans the differing chunk."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + chunk] == b[i:i + chunk]:
        i += chunk
    if i >= n:
        return n
    end = min(i + chunk, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def _safe_decode(decode: Callable[[list[int]], str] | None, ids: list[int]) -> str | None:
    """``decode(ids)``, or None without a decoder or if it raises (metrics must never stop training)."""
    if decode is None:
        return None
    try:
        return decode(ids)
    except Exception:  # noqa: BLE001 - an unknown id in a metrics path is not worth a crash
        return None


def _same_text(seq: list[int], prompt: list[int], d: int, decode: Callable[[list[int]], str]) -> bool | None:
    """Whether ``decode(seq)`` is a prefix of ``decode(prompt)``, given ``seq[:d] == prompt[:d]``; None
    if the decoder fails.

    Decodes from a few tokens before ``d`` only (the shared prefix decodes identically on both sides),
    so a break costs O(tokens after ``d``). A trailing U+FFFD of ``seq`` (a response cut inside a
    multi-byte character) is ignored.
    """
    start = max(0, d - 8)
    a, b = _safe_decode(decode, seq[start:]), _safe_decode(decode, prompt[start:])
    if a is None or b is None:
        return None
    return b.startswith(a.rstrip("\ufffd"))


def _record_break(stats: AggregateStats, cls: str, call: CallRecord, seq: list[int], prompt: list[int],
                  d: int, response_start: int, decode: Callable[[list[int]], str] | None) -> None:
    stats.merge_breaks += 1
    stats.merge_break_classes[cls] += 1
    examples = stats.merge_break_examples.setdefault(cls, [])
    if len(examples) >= stats.max_examples:
        return
    k = stats.example_context_tokens
    lo = max(0, d - k)
    row_ids, prompt_ids = seq[lo:d + k], prompt[lo:d + k]
    examples.append({"rollout_id": call.rollout_id, "attempt_id": call.attempt_id, "seq": call.seq,
                     "position": d, "row_tokens": len(seq), "prompt_tokens": len(prompt),
                     "response_start": response_start, "row_ids": row_ids, "prompt_ids": prompt_ids,
                     "row_text": _safe_decode(decode, row_ids), "prompt_text": _safe_decode(decode, prompt_ids)})


def classify_break(seq: list[int], prompt: list[int], response_start: int,
                   decode: Callable[[list[int]], str] | None = None) -> tuple[str, int]:
    """Class of a break between a row's full sequence ``seq`` and a next prompt that does not extend it.

    Args:
        seq: the current row's full token ids (prompt + response so far).
        prompt: the next call's prompt ids (not an exact extension of ``seq``).
        response_start: index in ``seq`` where the row's last sampled response begins.
        decode: token ids → text; without it (or if it raises) the class is ``"other"``.
    Returns:
        ``(class, d)``: one of ``retokenized``, ``template_rerender``, ``other``; ``d`` the first differing index.
    """
    d = first_difference(seq, prompt)
    same = _same_text(seq, prompt, d, decode) if decode is not None else None
    if same is None:  # no decoder, or it failed: the texts are unknown
        return "other", d
    if same:
        return "retokenized", d
    if response_start <= d < min(len(seq), len(prompt)):
        return "template_rerender", d
    return "other", d


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be a positive number of tokens or None, got {value!r}")


def build_rows(calls: list[CallRecord], mode: str = "trajectory", stats: AggregateStats | None = None, *,
               vocab: Vocabulary | None = None, max_prompt_tokens: int | None = None,
               max_response_tokens: int | None = None) -> list[Row]:
    """Rows of one rollout attempt's calls (ordered by ``seq``).

    Args:
        calls: the attempt's recorded calls; failed calls, calls that break the rules a record is written under
            (:func:`agl_common.schemas.record_fault`: a record edited in Redis), calls without token ids, calls that
            did not sample from the distribution their logprobs describe
            (:func:`agl_common.schemas.sampling_not_plain`: ``temperature: 0.7``, a ``top_p``, a bias...) and
            calls holding a token id past ``vocab.size`` are skipped, counted in ``stats.skipped_calls`` by reason.
        mode: ``"trajectory"`` (merge by exact token prefix) or ``"transition"`` (one row per call).
        stats: counters to add to (calls, rows, merge breaks by class with examples, skipped calls by
            reason, dropped and truncated rows).
        vocab: the trained model's :class:`Vocabulary` (None: nothing known). Its ``decode`` is used only on a
            merge break, to classify it and to render its examples (without it every id-mismatch break is
            ``other``). With its ``eos_ids`` (SmolLM2: ``{2}``, ``<|im_end|>``), a row whose last call finished
            with ``"stop"``/``"tool_calls"`` but whose response ids lack a final end-of-turn id is never extended:
            the next call starts a new row, counted as a ``missing_stop_token`` break. Its ``size`` bounds the ids.
        max_prompt_tokens: a row whose first prompt is longer is dropped (with every call merged into
            it) and counted in ``stats.dropped_rows["prompt_too_long"]``; None: no limit.
        max_response_tokens: a row's merged response (sampled + context tokens) is cut to this length,
            counted in ``stats.truncated_rows`` / ``truncated_tokens``; None: no limit.
    Returns:
        The rows, in call order. Cost: O(total prompt + response tokens) in trajectory mode (each
        prompt is compared once against a running copy of the row's sequence).
    Raises:
        ValueError: unknown ``mode``, or a limit below 1.
    """
    if mode not in ("trajectory", "transition"):
        raise ValueError(f"unknown aggregation mode {mode!r}")
    _check_limit("max_prompt_tokens", max_prompt_tokens)
    _check_limit("max_response_tokens", max_response_tokens)
    stats = stats if stats is not None else AggregateStats()
    vocab = vocab if vocab is not None else Vocabulary()
    decode, eos = vocab.decode, vocab.eos_ids
    rows: list[Row] = []  # every row started, dropped ones included (skipped at the end)
    dropped: set[int] = set()  # id() of dropped rows
    current: Row | None = None
    seq: list[int] = []  # running copy of current.full_ids()
    response_start = 0  # where current's last sampled response starts in seq
    last: CallRecord | None = None  # current's last call
    for call in sorted(calls, key=lambda c: c.seq):
        stats.calls += 1
        if not _usable(call, stats, vocab):
            continue
        prompt = call.prompt_token_ids
        if mode == "trajectory" and current is not None:
            n = len(seq)
            if call.role != current.role:
                _record_break(stats, "role_change", call, seq, prompt, first_difference(seq, prompt),
                              response_start, decode)
            elif len(prompt) >= n and prompt[n - 1] == seq[n - 1] and prompt[:n] == seq:
                if (eos is not None and last.finish_reason in STOP_FINISH_REASONS
                        and last.response_token_ids[-1] not in eos):
                    _record_break(stats, "missing_stop_token", call, seq, prompt, n, response_start, decode)
                else:
                    context = prompt[n:]
                    current.append_context(context)
                    current.append_response(call)
                    seq += context
                    response_start = len(seq)
                    seq += call.response_token_ids
                    last = call
                    continue
            else:
                cls, d = classify_break(seq, prompt, response_start, decode)
                _record_break(stats, cls, call, seq, prompt, d, response_start, decode)
        current = Row(rollout_id=call.rollout_id, prompt_ids=list(prompt), role=call.role)
        current.append_response(call)
        rows.append(current)
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            dropped.add(id(current))
        if mode == "trajectory":
            seq = current.prompt_ids + call.response_token_ids
            response_start = len(prompt)
            last = call
    kept = []
    for row in rows:
        if id(row) in dropped:
            stats.dropped_rows["prompt_too_long"] += 1
            stats.dropped_calls += row.n_calls
            continue
        if max_response_tokens is not None:
            cut = row.truncate_response(max_response_tokens)
            if cut:
                stats.truncated_rows += 1
                stats.truncated_tokens += cut
        kept.append(row)
    stats.rows += len(kept)
    return kept

