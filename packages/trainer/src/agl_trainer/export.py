"""Recorded rollouts as data sets: ``agl-trainer rollouts export --shape calls|rows|messages --format jsonl|parquet``.

Shapes (one record = one line of JSON Lines, one row of Parquet):

- ``calls``: every recorded call as the gateway stored it (:class:`~agl_common.schemas.CallRecord`, CONTRACT §3).
- ``rows``: what the trainer trains on, built by the code that trains (:func:`agl_trainer.algorithm.batch.select_groups` then
  :func:`agl_trainer.algorithm.batch.build_batch`) with the run's settings (``--config``: its ``config.json``; defaults
  otherwise) and the base model's end-of-turn ids: over the current attempt of each *succeeded, rewarded*
  rollout of the exported rollouts' groups (the group registry's members, so ``--rollout X`` gets the advantage
  its group gave it; a group with fewer than ``min_group_size`` such rollouts trains nothing), with
  ``max_prompt_tokens``/``max_response_tokens``, ``aggregation`` and the advantage (``advantage``,
  ``norm_by_std``, ``advantage_level``). Fields: ``rollout_id``, ``attempt_id``, ``group_id``, ``row`` (index
  in the rollout), ``reward``, ``advantage``, ``model_version``, ``role`` (the sub-agent's role whose calls it
  holds, None without roles), ``n_calls``, ``prompt_ids``, ``response_ids``,
  ``response_mask`` (1 = sampled, 0 = context), ``logprobs`` (nats, 0.0 at mask 0), ``has_logprobs``.
- ``messages``: SFT-ready chat conversations of the current attempt of each rollout (``ok`` chat-route calls):
  a call's request ``messages`` plus the assistant message it got back; a later call whose messages start
  with that conversation (and is of the same role) extends it, any other starts a new record. Fields:
  ``rollout_id``, ``attempt_id``, ``group_id``, ``reward``, ``status``, ``n_calls``, ``role`` (the sub-agent's
  role, None without roles), ``messages`` (``role``, ``content`` text, ``tool_calls``,
  ``tool_call_id``, ``name``), ``tools`` (the request's ``tools``). Calls on the Anthropic ``messages`` and
  ``responses`` routes are not converted (counted in :attr:`ExportStats.skipped_calls`).

Parquet is written through Hugging Face ``datasets`` (``Dataset.from_list(...).to_parquet``). Free-form JSON
(a call's ``request``/``response``, ``tools``) would give every file its own nested schema there, so in
Parquet those columns hold JSON text (``json.loads`` gives the object back); JSON Lines keeps them as objects.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from agl_common.schemas import CallRecord, Rollout, RolloutStatus, first_choice
from agl_common.store import Store

from .algorithm.aggregate import Vocabulary
from .algorithm.evalstats import outcome_reward
from .config import TrainConfig

Shape = Literal["calls", "rows", "messages"]
Format = Literal["jsonl", "parquet"]
#: Columns stored as JSON text in Parquet, per shape.
JSON_COLUMNS = {"calls": ("request", "response"), "rows": (), "messages": ("tools",)}


class ExportError(ValueError):
    """Bad export options or nothing to write; the message says which."""


@dataclass
class ExportFilter:
    """Which rollouts to export: every condition given holds. ``rollout``: this id; ``run``: the rollouts of this
    run, from the group registry (:meth:`agl_common.store.Store.run_rollout_ids`; with ``rollout``, that rollout
    only if it belongs to the run); ``status``: one of the rollout states;
    ``min_reward``: keep rollouts whose outcome reward (:func:`~agl_trainer.algorithm.evalstats.outcome_reward`:
    succeeded ones only) is ``>=`` this."""

    rollout: str | None = None
    run: str | None = None
    status: RolloutStatus | None = None
    min_reward: float | None = None

    def keep(self, r: Rollout) -> bool:
        """Whether ``r`` passes the conditions a rollout's record decides (all but ``run``)."""
        if self.status is not None and r.status != self.status:
            return False
        if self.min_reward is None:
            return True
        reward = outcome_reward(r)  # a reward posted by a rollout that then failed is not its outcome
        return reward is not None and reward >= self.min_reward


@dataclass
class ExportStats:
    rollouts: int = 0
    records: int = 0
    skipped_calls: Counter = field(default_factory=Counter)


async def select_rollouts(store: Store, flt: ExportFilter) -> list[Rollout]:
    """The rollouts matching ``flt``, oldest first. Raises ``RolloutNotFound`` for an unknown ``flt.rollout``."""
    members = None if flt.run is None else await store.run_rollout_ids(flt.run)
    if flt.rollout is not None:
        candidates = [await store.get_rollout(flt.rollout)]
        if members is not None and flt.rollout not in members:
            candidates = []
    else:
        candidates = await store.get_rollouts(await store.rollout_ids() if members is None else members,
                                              skip_missing=True)
    return [r for r in candidates if flt.keep(r)]


def _text(content: Any) -> str | None:
    """Message content as text: a string as it is, a list of parts joined (text parts only)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return json.dumps(content)


def _str(value: Any) -> str | None:
    """A field of the fixed message shape as text (None kept; anything else as JSON): one type per column, whatever
    the harness sent (a dict of tool arguments in one call and a string in the next broke the Parquet schema)."""
    return value if value is None or isinstance(value, str) else json.dumps(value)


def sft_message(m: dict[str, Any]) -> dict[str, Any]:
    """One chat message in a fixed shape: ``role``, ``content`` (text or None), ``tool_calls`` (list of
    ``{id, type, function: {name, arguments}}`` or None; entries that are not objects are left out), ``tool_call_id``,
    ``name``; every leaf a string or None (:func:`_str`)."""
    raw = m.get("tool_calls")
    calls = None
    if isinstance(raw, list) and raw:
        calls = []
        for c in raw:
            if not isinstance(c, dict):
                continue
            fn = c.get("function") if isinstance(c.get("function"), dict) else {}
            calls.append({"id": _str(c.get("id")), "type": _str(c.get("type", "function")),
                          "function": {"name": _str(fn.get("name")), "arguments": _str(fn.get("arguments"))}})
        calls = calls or None
    return {"role": _str(m.get("role")), "content": _str(_text(m.get("content"))), "tool_calls": calls,
            "tool_call_id": _str(m.get("tool_call_id")), "name": _str(m.get("name"))}


def conversations(calls: list[CallRecord], stats: ExportStats) -> list[tuple[list[dict], Any, int, str | None]]:
    """Chat conversations of one attempt's calls (ordered by ``seq``): ``(messages, tools, n_calls, role)`` each.
    A call extends the last conversation if that one is of its own role (:attr:`CallRecord.role`, None without
    roles) and its request starts with that conversation's messages. Calls of two roles are never one
    conversation, as training never merges them into one row (round 17: a checker's call that quoted the
    solver's conversation was merged into it, its role dropped)."""
    out: list[list] = []
    for c in sorted(calls, key=lambda c: c.seq):
        if c.status != "ok" or not isinstance(c.response, dict):
            stats.skipped_calls["error"] += 1
            continue
        if c.route != "chat":
            stats.skipped_calls[f"route_{c.route}"] += 1
            continue
        message = first_choice(c).get("message")
        if not isinstance(message, dict):
            stats.skipped_calls["no_message"] += 1
            continue
        sent = [sft_message(m) for m in c.request.get("messages", []) if isinstance(m, dict)]
        conv = sent + [sft_message(message)]
        last = out[-1] if out and out[-1][3] == c.role else None
        if last is not None and sent[:len(last[0])] == last[0]:
            last[0], last[1], last[2] = conv, c.request.get("tools") or last[1], last[2] + 1
        else:
            out.append([conv, c.request.get("tools"), 1, c.role])
    return [tuple(x) for x in out]


async def collect(store: Store, flt: ExportFilter, shape: Shape, cfg: TrainConfig | None = None,
                  vocab: Vocabulary | None = None, stats: ExportStats | None = None) -> list[dict[str, Any]]:
    """Records of ``shape`` for the rollouts matching ``flt`` (see the module docstring for each shape).

    ``cfg`` (the run's settings; defaults if None) and ``vocab`` (the trained model's
    :class:`~agl_trainer.algorithm.aggregate.Vocabulary`) are used by ``rows`` only, as training uses them
    (:func:`agl_trainer.algorithm.batch.build_batch`).

    Raises:
        ExportError: unknown ``shape``.
        agl_common.store.RolloutNotFound: ``flt.rollout`` does not exist.
    """
    if shape not in ("calls", "rows", "messages"):
        raise ExportError(f"unknown shape {shape!r}; choose calls, rows or messages")
    stats = stats if stats is not None else ExportStats()
    rollouts = await select_rollouts(store, flt)
    out: list[dict[str, Any]] = []
    if shape == "calls":
        for r in rollouts:
            out += [c.model_dump(mode="json") for c in await store.read_calls(r.rollout_id)]
    elif shape == "messages":
        for r in rollouts:
            for messages, tools, n, role in conversations(await store.read_calls(r.rollout_id, r.attempt_id),
                                                          stats):
                out.append({"rollout_id": r.rollout_id, "attempt_id": r.attempt_id, "group_id": r.group_id,
                            "reward": r.reward, "status": r.status.value, "n_calls": n, "role": role,
                            "messages": messages, "tools": tools})
    else:
        out = await _rows(store, rollouts, cfg or TrainConfig(), vocab)
    stats.rollouts, stats.records = len(rollouts), len(out)
    return out


async def group_members(store: Store, rollouts: list[Rollout]) -> list[Rollout]:
    """Every rollout of the groups of ``rollouts``, each once, in order: a registered group's members (the group
    registry); for a group never registered (rollouts made with ``rollouts create --group``), every rollout of the
    prefix that carries its id, whatever filter chose ``rollouts`` (its advantages must not change with the
    filter); a rollout without a group, itself."""
    by_group: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_group.setdefault(r.group_id or r.rollout_id, []).append(r)
    out: dict[str, Rollout] = {}
    infos = await store.groups(list(by_group))
    everyone: list[Rollout] | None = None
    for (gid, given), info in zip(by_group.items(), infos):
        if info is not None:
            out.update((r.rollout_id, r) for r in await store.get_rollouts(info.rollout_ids, skip_missing=True))
        elif given[0].group_id is None:
            out.update((r.rollout_id, r) for r in given)
        else:
            if everyone is None:  # read once, only for unregistered groups
                everyone = await store.get_rollouts(await store.rollout_ids(), skip_missing=True)
            out.update((r.rollout_id, r) for r in everyone if r.group_id == gid)
    return list(out.values())


async def _rows(store: Store, rollouts: list[Rollout], cfg: TrainConfig,
                vocab: Vocabulary | None) -> list[dict[str, Any]]:
    """The training rows of ``rollouts``: training's own selection and batch builder over their whole groups
    (:func:`agl_trainer.algorithm.batch.select_groups` with ``cfg.min_group_size``, then
    :func:`agl_trainer.algorithm.batch.build_batch`), only the given rollouts' rows kept."""
    from .algorithm.batch import build_batch, select_groups

    kept, _ = select_groups(await group_members(store, rollouts), cfg.min_group_size)
    calls = {r.rollout_id: await store.read_calls(r.rollout_id, r.attempt_id) for r in kept}
    rows, advantages, _, _ = build_batch(kept, calls, cfg, vocab)
    wanted = {r.rollout_id: r for r in rollouts}
    out, index = [], Counter()
    for row, a in zip(rows, advantages):
        r = wanted.get(row.rollout_id)
        if r is None:
            continue
        out.append({"rollout_id": r.rollout_id, "attempt_id": r.attempt_id, "group_id": r.group_id,
                    "row": index[r.rollout_id], "reward": r.reward, "advantage": a, "model_version": row.model_version,
                    "role": row.role, "n_calls": row.n_calls, "prompt_ids": row.prompt_ids, "response_ids": row.response_ids,
                    "response_mask": row.response_mask, "logprobs": row.old_logprobs,
                    "has_logprobs": row.has_logprobs})
        index[r.rollout_id] += 1
    return out


def write(records: list[dict[str, Any]], shape: Shape, fmt: Format, out: Path | None, stream=None) -> None:
    """Write ``records`` as JSON Lines (to ``out``, else ``stream``) or as Parquet (to ``out``, required). A file is
    written whole or not at all (:func:`_replaced_whole`): a write that fails (a full disk, ``ulimit -f``) or is
    interrupted leaves ``out`` as it was.

    Raises:
        ExportError: unknown format, Parquet without ``out``, or Parquet with no record (no file is written).
        OSError: ``out`` cannot be written (``out`` left as it was).
    """
    if fmt == "jsonl":
        if out is None:
            for rec in records:
                stream.write(orjson.dumps(rec) + b"\n")
            return
        with _replaced_whole(Path(out)) as tmp, open(tmp, "wb") as f:
            for rec in records:
                f.write(orjson.dumps(rec) + b"\n")
        return
    if fmt != "parquet":
        raise ExportError(f"unknown format {fmt!r}; choose jsonl or parquet")
    if out is None:
        raise ExportError("--format parquet writes a file: give --out FILE.parquet")
    if not records:
        raise ExportError("no record matched the filters: no Parquet file written")
    try:
        from datasets import Dataset
    except ImportError:
        raise ExportError("--format parquet needs the datasets library: pip install datasets==5.2.0") from None
    cols = JSON_COLUMNS[shape]
    rows = [{k: (json.dumps(v) if k in cols and v is not None else v) for k, v in rec.items()} for rec in records]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with _replaced_whole(Path(out)) as tmp:
        Dataset.from_list(rows).to_parquet(str(tmp))


def _has_xattrs(path: Path) -> bool:
    """Whether ``path`` has extended attributes (an ACL among them); ``False`` where they cannot be listed."""
    try:
        return bool(os.listxattr(path))
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def _replaced_whole(out: Path):
    """Yield the path to write ``out``'s new content to: a temporary file beside it that replaces it in one step
    (``os.replace``, with ``out``'s mode if it existed, else the umask's) when the block ends without an error, and is
    removed on any error or interrupt, ``out`` left as it was (an export cut by a full disk or SIGTERM had truncated
    the file it replaced). ``out`` itself (written in place, as before) where replacing it would change what it is:
    no regular file (``/dev/stdout``, a pipe, a FIFO), a file with other hard links or extended attributes (an ACL),
    one whose owner and group this user cannot give the new file (another user's), a folder this user may not
    create files in. The new file gets ``out``'s owner, group and mode. An existing ``out`` this user may not write is refused (``PermissionError``) as opening it
    would be; a link is followed (its target replaced)."""
    try:
        st = os.stat(out)
    except FileNotFoundError:
        st = None
    if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or _has_xattrs(out)):
        yield out
        return
    if st is not None:
        os.close(os.open(out, os.O_WRONLY))  # (a read-only file: PermissionError, as `open(out, "wb")` gave)
    target = Path(os.path.realpath(out))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:100]}.", suffix=".part", dir=target.parent)
    except PermissionError:  # (a folder with no room for a file of this user's: in place, as before)
        yield out
        return
    os.close(fd)
    if st is not None:
        try:  # its owner and group (root replacing a user's file took it; a group lost its write access)
            os.chown(tmp, st.st_uid, st.st_gid)
        except OSError:  # (another user's, a group this user is not in, an id a user namespace cannot map: in place)
            os.unlink(tmp)
            yield out
            return
    try:
        yield Path(tmp)
        if st is not None:
            mode = st.st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
