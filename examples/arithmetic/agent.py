"""An arithmetic agent on the OpenAI Agents SDK: solve, then check its own work (2 model calls).

Nothing here knows about AGL: the OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY from the
environment as usual. The evaluator at the bottom reads the task from AGL_INPUT and posts the reward
to AGL_REWARD_URL (CONTRACT §2), the way any harness's evaluator would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).parent))
from task import report  # noqa: E402

INSTRUCTIONS = "You solve short arithmetic word problems. Think briefly, then give the answer as a number."
CHECK = "Check your work. Reply with only the final number."


async def solve(question: str) -> str:
    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model=os.environ.get("AGL_MODEL", "gpt-4o-mini"), openai_client=AsyncOpenAI())
    agent = Agent(name="solver", instructions=INSTRUCTIONS, model=model,
                  model_settings=ModelSettings(temperature=1.0, max_tokens=64))
    first = await Runner.run(agent, question)
    second = await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": CHECK}])
    return str(second.final_output)


def main() -> None:
    task = json.loads(os.environ["AGL_INPUT"])
    answer = asyncio.run(solve(task["question"]))
    report(task, answer)


if __name__ == "__main__":
    main()
