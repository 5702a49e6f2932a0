"""An arithmetic agent on the OpenAI Agents SDK: one model call (default), or solve then check (``--self-check``).

Nothing here knows about AGL: the OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY from the
environment as usual. The evaluator at the bottom reads the task from AGL_INPUT and posts the reward
to AGL_REWARD_URL (CONTRACT §2), the way any harness's evaluator would.

    python examples/arithmetic/agent.py [--self-check] [--max-tokens N]

``--self-check`` adds a second turn ("Check your work...") whose reply is the answer: two calls per
rollout, merged into one trajectory by the trainer.
"""

from __future__ import annotations

import argparse
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


async def solve(question: str, self_check: bool = False, max_tokens: int = 64) -> str:
    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model=os.environ.get("AGL_MODEL", "gpt-4o-mini"), openai_client=AsyncOpenAI())
    agent = Agent(name="solver", instructions=INSTRUCTIONS, model=model,
                  model_settings=ModelSettings(temperature=1.0, max_tokens=max_tokens))
    result = await Runner.run(agent, question)
    if self_check:
        result = await Runner.run(agent, result.to_input_list() + [{"role": "user", "content": CHECK}])
    return str(result.final_output)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-check", action="store_true", help="ask a second turn to check the answer")
    ap.add_argument("--max-tokens", type=int, default=64, help="token budget of each reply")
    args = ap.parse_args()
    task = json.loads(os.environ["AGL_INPUT"])
    answer = asyncio.run(solve(task["question"], args.self_check, args.max_tokens))
    report(task, answer)


if __name__ == "__main__":
    main()
