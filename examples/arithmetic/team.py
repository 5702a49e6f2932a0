"""A two-agent arithmetic team on the OpenAI Agents SDK: a solver, a retry when its reply holds no number, and a
checker with its own instructions. 1 to 4 model calls per rollout; the reward comes only at the end.

Nothing here knows about AGL: the OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment
as usual; the evaluator at the bottom reads the task from AGL_INPUT and posts the reward to AGL_REWARD_URL
(CONTRACT §2), the way any harness's evaluator would.

    python examples/arithmetic/team.py [--max-tokens N] [--checker-max-tokens N] [--retries N]
                                       [--solver-model NAME] [--checker-model NAME]

Each agent names its model, as frameworks let it (default: ``AGL_MODEL`` for both): with a model name per agent,
a gateway that trains a policy per sub-agent (``roles`` in examples/arithmetic/roles.yaml) routes each agent's
calls to its own adapter; the code is the same either way.

The flow, ordinary agent code:

1. the **solver** answers the question;
2. if its reply holds no number, it is asked again in the same conversation ("Give the answer as a
   number."), at most ``--retries`` times (default 2);
3. a reply that is a bare number is final; any other reply with a number goes to the **checker**, a second
   agent with its own instructions, which sees the question and the solver's working in a fresh conversation
   and is asked for only the correct final number. Its reply is a verdict only if it holds exactly one number
   ("7", "The answer is 7."); a reply with several numbers is working, not a verdict (often cut at its token
   budget, its last number an intermediate one), and the solver's answer stands.

So a rollout makes 1 call (a bare number at once), 2 (solver + checker, or a retry that gives a bare number),
3 or 4; the solver's retry extends its own conversation (one training row), the checker's call starts another
(its system prompt differs): 1 or 2 rows per rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).parent))
from task import final_number, numbers, report  # noqa: E402

SOLVER = "You solve short arithmetic word problems. Think briefly, then give the answer as a number."
RETRY = "Give the answer as a number."
CHECKER = ("You check a student's answer to an arithmetic word problem. Work it out yourself, then reply with "
           "only the correct final number.")
_BARE = re.compile(r"\s*-?\d+(?:\.\d+)?\s*\.?\s*")


def is_bare_number(text: str) -> bool:
    """True for a reply that is only a number (``"7"``, ``" 7."``): final without a check."""
    return bool(_BARE.fullmatch(text or ""))


def verdict(text: str) -> float | None:
    """The checker's verdict: the number of a reply that holds exactly one (``"7"``, ``"The answer is 7."``),
    else None (no number, or several: working, whose last number need not be the answer)."""
    found = numbers(text)
    return found[0] if len(found) == 1 else None


async def solve(question: str, max_tokens: int = 64, retries: int = 1, solver_model: str | None = None,
                checker_model: str | None = None, checker_max_tokens: int = 32) -> tuple[str, list[str]]:
    """The team's final answer and the agents that were called, in order (``solver``, ``checker``); each agent
    asks for its own model name (default ``AGL_MODEL``). ``max_tokens``: the solver's budget per reply,
    ``checker_max_tokens`` the checker's (a verdict is one number: a short budget)."""
    set_tracing_disabled(True)
    client = AsyncOpenAI()
    default = os.environ.get("AGL_MODEL", "gpt-4o-mini")
    solver = Agent(name="solver", instructions=SOLVER,
                   model_settings=ModelSettings(temperature=1.0, max_tokens=max_tokens),
                   model=OpenAIChatCompletionsModel(model=solver_model or default, openai_client=client))
    checker = Agent(name="checker", instructions=CHECKER,
                    model_settings=ModelSettings(temperature=1.0, max_tokens=checker_max_tokens),
                    model=OpenAIChatCompletionsModel(model=checker_model or default, openai_client=client))
    calls = ["solver"]
    result = await Runner.run(solver, question)
    answer = str(result.final_output)
    for _ in range(retries):
        if final_number(answer) is not None:
            break
        calls.append("solver")
        result = await Runner.run(solver, result.to_input_list() + [{"role": "user", "content": RETRY}])
        answer = str(result.final_output)
    if final_number(answer) is None or is_bare_number(answer):
        return answer, calls
    calls.append("checker")
    checked = await Runner.run(checker, f"Problem: {question}\nStudent's answer: {answer}")
    reply = str(checked.final_output)
    return (reply if verdict(reply) is not None else answer), calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64, help="token budget of each solver reply")
    ap.add_argument("--checker-max-tokens", type=int, default=32, help="token budget of the checker's reply")
    ap.add_argument("--retries", type=int, default=2, help="times the solver is asked again for a number")
    ap.add_argument("--solver-model", help="the solver's model name (default: $AGL_MODEL)")
    ap.add_argument("--checker-model", help="the checker's model name (default: $AGL_MODEL)")
    args = ap.parse_args()
    task = json.loads(os.environ["AGL_INPUT"])
    answer, calls = asyncio.run(solve(task["question"], args.max_tokens, args.retries, args.solver_model,
                                      args.checker_model, args.checker_max_tokens))
    print(json.dumps({"calls": calls}))
    report(task, answer)


if __name__ == "__main__":
    main()
