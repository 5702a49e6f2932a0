"""A calculator agent on the OpenAI Agents SDK with its default model: the Responses API.

``Agent(model="<name>")`` resolves through the SDK's default provider to ``OpenAIResponsesModel`` on an
``AsyncOpenAI()`` client, which reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment: under AGL
every model call is a ``POST /v1/responses`` to the gateway, recorded with its token ids. Nothing here
knows about AGL; ``main()`` is the evaluator: it reads the task from AGL_INPUT and posts the reward to
AGL_REWARD_URL (CONTRACT §2), with the problems and the reward of examples/arithmetic/task.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Literal

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, ModelSettings, Runner, function_tool,
                    set_tracing_disabled)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic"))
from task import report  # noqa: E402  (the problems and reward of examples/arithmetic)

INSTRUCTIONS = ("You solve short arithmetic word problems. Use the calculator tool for the arithmetic, "
                "then reply with the final answer as a number.")


@function_tool
def calculator(a: float, op: Literal["+", "-", "*", "/"], b: float) -> str:
    """Compute `a op b`.

    Args:
        a: the left operand.
        op: one of + - * /.
        b: the right operand.
    """
    if op == "/" and b == 0:
        return "error: division by zero"
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[op]
    return f"{value:g}"


async def solve(question: str) -> str:
    set_tracing_disabled(True)  # the SDK's trace exporter would call api.openai.com with the key
    agent = Agent(name="calculator-agent", instructions=INSTRUCTIONS, tools=[calculator],
                  model=os.environ.get("AGL_MODEL", "gpt-4.1-mini"),
                  model_settings=ModelSettings(temperature=1.0, max_tokens=96))
    result = await Runner.run(agent, question, max_turns=4)
    return str(result.final_output)


def main() -> None:
    task = json.loads(os.environ["AGL_INPUT"])
    try:
        answer = asyncio.run(solve(task["question"]))
    except (MaxTurnsExceeded, ModelBehaviorError) as exc:
        # the model gave no usable answer: it kept calling tools, ran past max_tokens (the SDK raises on an
        # `incomplete` response) or called a tool wrongly. That scores 0; an infrastructure error still raises.
        print(f"no answer: {type(exc).__name__}: {exc}")
        answer = ""
    report(task, answer)


if __name__ == "__main__":
    main()
