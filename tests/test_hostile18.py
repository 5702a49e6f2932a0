"""Round 18 of hostile input (docs/operations.md, "An eighteenth round"): each test failed before its fix."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import httpx
import pytest
from agl_common.schemas import CallRecord, Rollout, RolloutStatus

from test_gateway import gateway, make_rollout, upstream  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent


def _call(rid: str, prompt: list[int], response: list[int]) -> CallRecord:
    return CallRecord(rollout_id=rid, attempt_id="0", seq=0, route="chat", request={}, response={},
                      prompt_token_ids=prompt, response_token_ids=response, finish_reason="stop",
                      response_logprobs=[-0.5] * len(response))


def test_a_token_id_past_the_vocabulary_is_skipped_not_trained():
    """Left open by round 16: token ids were never compared with the trained model's vocabulary. An engine serving
    another model (a bigger vocabulary) gave ``ok`` records whose ids went into the rows, and the first update
    failed with an ``IndexError`` in the embedding, after minutes of rollouts. A call holding an id past the
    vocabulary is now skipped as ``token_id_outside_vocabulary`` (the rollout leaves the advantage statistics, as
    one without a usable call does), in the prompt or in the response."""
    from agl_trainer.algorithm.aggregate import AggregateStats, Vocabulary, build_rows
    from agl_trainer.algorithm.batch import build_batch
    from agl_trainer.config import TrainConfig

    vocab = Vocabulary(size=100)
    rollouts = [Rollout(rollout_id=f"r{i}", group_id="g", status=RolloutStatus.succeeded, reward=float(i % 2))
                for i in range(4)]
    calls = {"r0": [_call("r0", [1, 2], [3, 4])], "r1": [_call("r1", [1, 2], [3, 100])],
             "r2": [_call("r2", [1, 99], [5, 6])], "r3": [_call("r3", [1, 150_000], [5, 6])]}
    rows, adv, stats, _ = build_batch(rollouts, calls, TrainConfig(), vocab)
    assert [r.rollout_id for r in rows] == ["r0", "r2"] and len(adv) == 2
    assert stats.skipped_calls == {"token_id_outside_vocabulary": 2}
    assert max(max(r.prompt_ids + r.response_ids) for r in rows) < 100
    # without a known size nothing is bounded (ids are still in [0, 2**31): the gateway's check)
    assert len(build_rows(calls["r3"], stats=AggregateStats(), vocab=Vocabulary())) == 1


def test_the_vocabulary_size_is_the_models_embedding_else_the_tokenizers(tmp_path):
    """The bound is the number of ids the model embeds (``config.json``'s ``vocab_size``, often padded past the
    tokenizer), else the tokenizer's length for a tokenizer-only directory (``ui --tokenizer``)."""
    import shutil

    from agl_trainer.model import load_vocabulary
    from agl_trainer.ui.traces import load_decoder
    from transformers import AutoTokenizer

    tiny = ROOT / "packages" / "trainer" / "src" / "agl_trainer" / "assets" / "tiny-tokenizer"
    n = len(AutoTokenizer.from_pretrained(tiny))
    assert load_vocabulary(tiny).size == load_decoder(str(tiny)).size == n
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": n + 64}))
    assert load_vocabulary(model).size == n + 64
    (model / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"vocab_size": n + 8}}))
    assert load_vocabulary(model).size == n + 8


@pytest.mark.timeout(300)
def test_the_run_loop_never_hands_an_update_an_id_past_the_vocabulary(tmp_path, redis_url, prefix):
    """The whole loop (real gateway, controller, harnesses; the shared fake engine, whose answers hold ids up to a
    few hundred) with a vocabulary of 8 ids: every call is skipped and counted in the step's metrics, no update is
    given a row (before: every row went to the update)."""
    from agl_trainer.algorithm.aggregate import Vocabulary
    from agl_trainer.config import TrainConfig
    from agl_trainer.loop import train_async
    from agl_trainer.services import Services
    from agl_trainer.stack import start_agents
    from rich.console import Console

    from fakes import Served, fake_upstream
    from test_loop import TASKS, RecordingBackend

    (tmp_path / "tasks.py").write_text(TASKS)
    cfg = TrainConfig(command=f"python {ROOT / 'tests' / 'harnesses' / 'eval_agent.py'}",
                      task_file=str(tmp_path / "tasks.py"), train_fn="train_problems", heldout_fn="heldout_problems",
                      steps=1, groups_per_step=2, group_size=2, eval_size=1, eval_subset=1, eval_every=0,
                      concurrency=8, rollout_timeout_s=60, preload=[], redis_url=redis_url, prefix=prefix,
                      out_dir=str(tmp_path / "runs"), loggers=["jsonl"])
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    with Served(fake_upstream()) as engine, Services(run_dir / "logs") as svc:
        start_agents(svc, cfg, engine.url, redis_url, cfg.model_name, run_dir / "logs" / "rollouts")
        backend = RecordingBackend(cfg.model_name)
        asyncio.run(train_async(cfg, run_dir, Console(file=io.StringIO()), redis_url, None, backend,
                                Vocabulary(size=8)))
    assert all(not rows for rows, _ in backend.updates)
    (step,) = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "eval" not in m and "step" in m]
    assert step["skipped_calls"] == {"token_id_outside_vocabulary": 4} and step["rows"] == 0


def test_yaml_booleans_are_true_and_false_only(tmp_path):
    """Left open by round 17: PyYAML reads YAML 1.1, where ``yes``/``no``/``on``/``off`` are booleans, so a key
    ``yes:`` was named ``True`` in the error and a role's model named ``no`` became ``False`` (refused as not a
    string). The config's YAML now has YAML 1.2's booleans; a boolean field still takes ``yes``."""
    import pydantic
    from agl_trainer.config import TrainConfig

    path = tmp_path / "c.yaml"
    path.write_text("yes: 3\n")
    with pytest.raises(pydantic.ValidationError, match=r"(?s)\byes\b.*Extra inputs"):
        TrainConfig.from_yaml(path)
    path.write_text("policy_serving: adapter\nroles:\n  solver: {models: [no]}\n  checker: {models: [off]}\n")
    cfg = TrainConfig.from_yaml(path)
    assert cfg.roles["solver"].models == ["no"] and cfg.roles["checker"].models == ["off"]
    path.write_text("steps: 2\nnorm_by_std: on\n")
    assert TrainConfig.from_yaml(path).norm_by_std is True
    path.write_text("steps: 2\nnorm_by_std: False\n")
    assert TrainConfig.from_yaml(path).norm_by_std is False


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]}),
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "3+4?"}], "stream": True,
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("messages", {"model": "m", "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_an_agent_that_leaves_a_call_that_is_not_a_live_stream_stops_its_generation(
        store, redis_url, prefix, upstream, route, body):
    """The gateway prober: an agent leaving a complete answer, a chat stream with tools or an Anthropic stream (all
    answered whole, then sent) kept the engine generating until its answer came, and a pause's drain waited for
    it (up to ``upstream_timeout_s``); Esc in a coding agent or an SDK timeout wasted a whole generation each
    time. The engine's call is now cancelled as soon as the agent goes away (as a live stream's is), the call is
    recorded ``abandoned`` at once and the drain does not wait for it."""
    import time

    from agl_common.control import pause_and_drain, resume

    await make_rollout(store)
    with gateway(redis_url, prefix, upstream.url) as gw:
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", json=body, timeout=60)
            assert r.status_code == 200  # (LiteLLM imported: the next call reaches the engine at once)
            with pytest.raises(httpx.TimeoutException):  # the engine takes 30 s; the agent gives up after 0.5 s
                await c.post(f"{gw.url}/rollouts/r1/attempts/0/v1/{route}", json={**body, "x_delay": 30},
                             timeout=0.5)
        t0 = time.monotonic()
        await pause_and_drain(store, pause_id="P", timeout_s=20)
        drained_s = time.monotonic() - t0
        await resume(store, release="P")
        ok, rec = await store.read_calls("r1")
    assert drained_s < 10 and ok.status == "ok", drained_s
    assert rec.status == "error" and rec.error.startswith("abandoned") and rec.latency_ms < 10_000, rec
