"""AGL controller: turns queued rollouts into harness runs and keeps their state true."""

from .local import LocalRunner, harness_env

__all__ = ["LocalRunner", "harness_env"]
