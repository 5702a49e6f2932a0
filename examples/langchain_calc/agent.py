"""A calculator agent on LangChain: ``ChatOpenAI`` plus LangChain's tool-calling agent (``create_agent``).

``ChatOpenAI()`` without a ``base_url`` lets the ``openai`` client read OPENAI_BASE_URL and OPENAI_API_KEY
from the environment, so under AGL every model call is a ``POST /v1/chat/completions`` to the gateway,
recorded with its token ids. Nothing here knows about AGL; ``main()`` is the evaluator: it reads the task
from AGL_INPUT and posts the reward to AGL_REWARD_URL (CONTRACT §2), with the problems and the reward of
examples/arithmetic/task.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Literal

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic"))
from task import report  # noqa: E402  (the problems and reward of examples/arithmetic)

SYSTEM_PROMPT = ("You solve short arithmetic word problems. Use the calculator tool for the arithmetic, "
                 "then reply with the final answer as a number.")


@tool
def calculator(a: float, op: Literal["+", "-", "*", "/"], b: float) -> str:
    """Compute `a op b` (op is one of + - * /)."""
    if op == "/" and b == 0:
        return "error: division by zero"
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[op]
    return f"{value:g}"


def solve(question: str) -> str:
    model = ChatOpenAI(model=os.environ.get("AGL_MODEL", "gpt-4.1-mini"), temperature=1.0, max_tokens=96)
    agent = create_agent(model, tools=[calculator], system_prompt=SYSTEM_PROMPT)
    # each model turn and each tool turn is a graph step: 8 steps leave room for three tool rounds
    state = agent.invoke({"messages": [{"role": "user", "content": question}]}, {"recursion_limit": 8})
    return str(state["messages"][-1].content)


def main() -> None:
    task = json.loads(os.environ["AGL_INPUT"])
    try:
        answer = solve(task["question"])
    except GraphRecursionError:  # the agent kept calling tools and gave no answer: that scores 0
        answer = ""
    report(task, answer)


if __name__ == "__main__":
    main()
