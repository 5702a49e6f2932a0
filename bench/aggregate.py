#!/usr/bin/env python
"""Throughput of ``agl_trainer.algorithm.aggregate.build_rows`` on long multi-call rollouts (synthetic, seeded).

Each synthetic rollout is one attempt of ``--calls`` calls that merge exactly: call ``k``'s prompt is
call ``k-1``'s prompt + response + ``--context-tokens`` new context tokens (template newline, a tool
result, the next user turn); each response has ``--response-tokens`` tokens and ends with the
end-of-turn id 2. With the defaults (200 rollouts × 20 calls, ~1k new tokens per call) every rollout
becomes one row of ~20k tokens, and the calls hold ~41M recorded tokens in all (each prompt repeats
the whole history, as the gateway records it).

Reported per case (wall time of ``build_rows`` only; building the records is not timed):

- ``rows/s``: rows built per second;
- ``row tok/s``: tokens in the built rows (prompt + response) per second;
- ``recorded tok/s``: tokens of the input records (every call's prompt + response) per second: the
  work the prefix check has to read.

Run: ``.venv/bin/python bench/aggregate.py`` (~1 min on 2 busy cores; ``--rollouts 50`` for a quick look).
No asserts: it prints numbers.
"""

from __future__ import annotations

import argparse
import random
import time

from agl_common.schemas import CallRecord
from agl_trainer.algorithm.aggregate import AggregateStats, Vocabulary, build_rows

IM_END = 2


def synthetic_rollout(rng: random.Random, rid: str, calls: int, first_prompt: int, context: int,
                      response: int, break_every: int = 0) -> list[CallRecord]:
    """``calls`` records of one attempt; with ``break_every > 0`` every such call's prompt re-renders
    the previous response's first token (a ``template_rerender`` break)."""
    out = []
    prompt = [rng.randrange(3, 49152) for _ in range(first_prompt)]
    for k in range(calls):
        resp = [rng.randrange(3, 49152) for _ in range(response - 1)] + [IM_END]
        out.append(CallRecord.model_construct(
            rollout_id=rid, attempt_id="0", seq=k, route="chat", request={}, response=None,
            prompt_token_ids=prompt, response_token_ids=resp, response_logprobs=[-0.5] * len(resp),
            finish_reason="stop", model_version=0, status="ok"))
        echoed = list(resp)
        if break_every and (k + 1) % break_every == 0:
            echoed[0] = (echoed[0] + 1) % 49152 or 3
        prompt = prompt + echoed + [rng.randrange(3, 49152) for _ in range(context)]
    return out


def run_case(name: str, data: list[list[CallRecord]], **kw) -> dict:
    stats = AggregateStats()
    t0 = time.perf_counter()
    rows = [r for calls in data for r in build_rows(calls, stats=stats, **kw)]
    dt = time.perf_counter() - t0
    row_tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    rec_tokens = sum(len(c.prompt_token_ids) + len(c.response_token_ids) for calls in data for c in calls)
    res = {"case": name, "s": dt, "rows": len(rows), "rows/s": len(rows) / dt, "row tok/s": row_tokens / dt,
           "recorded tok/s": rec_tokens / dt, "breaks": stats.merge_breaks}
    print(f"{name:<40} {dt:7.3f} s  rows {len(rows):6d}  {res['rows/s']:10.0f} rows/s  "
          f"{res['row tok/s'] / 1e6:7.2f} M row tok/s  {res['recorded tok/s'] / 1e6:7.1f} M recorded tok/s  "
          f"breaks {stats.merge_breaks}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=200)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--first-prompt-tokens", type=int, default=700)
    ap.add_argument("--context-tokens", type=int, default=700, help="new context tokens before each next call")
    ap.add_argument("--response-tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    data = [synthetic_rollout(rng, f"r{i}", args.calls, args.first_prompt_tokens, args.context_tokens,
                              args.response_tokens) for i in range(args.rollouts)]
    broken = [synthetic_rollout(rng, f"b{i}", args.calls, args.first_prompt_tokens, args.context_tokens,
                                args.response_tokens, break_every=5) for i in range(max(1, args.rollouts // 4))]
    print(f"{args.rollouts} rollouts × {args.calls} calls, ~{args.context_tokens + args.response_tokens} new "
          f"tokens per call (records built in {time.perf_counter() - t0:.1f} s, not timed)")
    run_case("trajectory", data)
    run_case("trajectory + eos check + limits", data, vocab=Vocabulary(eos_ids=frozenset({IM_END}), size=49_152),
             max_prompt_tokens=100_000,
             max_response_tokens=32_768)
    run_case("transition", data, mode="transition")
    run_case(f"trajectory, break every 5 calls ({len(broken)} r.)", broken,
             vocab=Vocabulary(lambda ids: " ".join(map(str, ids))))


if __name__ == "__main__":
    main()
