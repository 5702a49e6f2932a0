"""A small recorded run for the dashboard tests: calls written by the real gateway, plus a run directory.

The upstream is a character-level stand-in engine: a prompt's token ids are the code points of the
rendered chat (``<role>content\\n`` per message, then ``<assistant>``), the answer's ids are the code
points of its text plus ``\\n`` (id 10, the end of turn), and the logprobs are the fake engine's
(:func:`fakes.chat_logprob`). So :func:`decode` (``chr``) is an exact tokenizer, merges happen when a harness
sends its history back unchanged, and a re-rendered assistant turn is a ``template_rerender`` merge break.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from agl_common.schemas import GroupInfo, Rollout, RolloutStatus

from fakes import fake_upstream

EOS = 10


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def render(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"


def char_upstream():
    """The fake engine (tests/fakes.py) with a character-level tokenizer; it answers a request's ``x_answer``
    (default "7")."""
    return fake_upstream(reply=lambda body: body.get("x_answer", "7"),
                         prompt_ids=lambda body: [ord(c) for c in render(body["messages"])],
                         reply_ids=lambda message: [ord(c) for c in message["content"]] + [EOS], model="char-model")


def agent(gateway: str, rid: str, question: str, answer: str, rerender: bool) -> None:
    """A three-call harness: answer, check (history sent back as is: merges), answer again with its
    first answer re-rendered (``" " + answer``) when ``rerender``: a merge break."""
    url = f"{gateway}/rollouts/{rid}/attempts/0/v1/chat/completions"
    history = [{"role": "user", "content": question}]
    with httpx.Client(timeout=30) as c:
        for turn in range(3):
            r = c.post(url, json={"model": "agent", "messages": history, "x_answer": answer})
            r.raise_for_status()
            said = r.json()["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": " " + said if rerender and turn == 1 else said})
            history.append({"role": "user", "content": "Check your work." if turn == 0 else "Final answer?"})


async def record_run(store, gateway: str, runs_dir: Path, run_id: str) -> dict:
    """Record one step of two groups through ``gateway`` and write ``runs_dir/test/{run_id}/``.

    Group ``{run_id}-q0-g0``: 4 rollouts, rewards 1, 0, 1, 0 (signal); rollout 1 re-renders its history
    (a merge break). Group ``{run_id}-q1-g0``: rewards 0, 0, 0 and one failed rollout (``timeout``):
    equal rewards, no signal. Returns ``{"groups": {gid: [rollout ids]}, "run_dir": Path}``.
    """
    import asyncio

    plan = {f"{run_id}-q0-g0": [(1.0, "7", False), (0.0, "8", True), (1.0, "7", False), (0.0, "9", False)],
            f"{run_id}-q1-g0": [(0.0, "5", False), (0.0, "5", False), (0.0, "4", False), (None, "3", False)]}
    questions = {f"{run_id}-q0-g0": "What is 3 + 4?", f"{run_id}-q1-g0": "What is 2 + 2?"}
    out = {}
    for gid, members in plan.items():
        out[gid] = []
        # registered as the trainer's scheduler registers its groups (the dashboard finds a rollout's run by it)
        await store.register_group(GroupInfo(group_id=gid, rollout_ids=[f"{gid}-{i}" for i in range(len(members))],
                                             owner=run_id, run=run_id))
        for i, (reward, answer, rerender) in enumerate(members):
            rid = f"{gid}-{i}"
            await store.create_rollout(Rollout(rollout_id=rid, input={"question": questions[gid]}, group_id=gid,
                                               status=RolloutStatus.running), enqueue=False)
            await asyncio.to_thread(agent, gateway, rid, questions[gid], answer, rerender)
            if reward is None:
                await store.set_status(rid, RolloutStatus.failed, "timeout")
            else:
                r = httpx.post(f"{gateway}/rollouts/{rid}/attempts/0/reward", json={"value": reward})
                assert r.status_code == 200, r.text
                await store.set_status(rid, RolloutStatus.succeeded)
            out[gid].append(rid)
    run_dir = Path(runs_dir) / "test" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"model_name": "char-model", "group_size": 4,
                                                     "aggregation": "trajectory", "advantage": "grpo",
                                                     "norm_by_std": True, "min_group_size": 2}))
    lines = [{"eval": "before", "accuracy": 0.25, "n": 4, "failed": 0},
             step_line(1, list(plan))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return {"groups": out, "run_dir": run_dir}


def step_line(step: int, groups: list[str]) -> dict:
    """A metrics line with the shared vocabulary's fields (HELPERS: issue 12)."""
    return {"step": step, "policy_version": step - 1, "reward_mean": 0.5 / step, "accuracy": 0.4, "loss": 0.1 * step,
            "kl": 0.01 * step, "ratio_mean": 1.0, "clip_frac": 0.0, "rows": 8, "merge_breaks": 1, "failed": 1,
            "groups": groups, "time_generation_s": 3.0, "time_wait_s": 0.5, "time_update_s": 1.5,
            "time_weight_load_s": 0.4, "time_pause_drain_s": 0.1, "step_s": 5.5}
