"""AGL gateway: OpenAI-compatible LLM proxy that tags, forwards and records every model call."""

from .app import create_app
from .settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
