"""One router per route family: OpenAI-shaped model routes, rollout routes, operations."""
