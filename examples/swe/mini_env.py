"""``SandboxedEnvironment``: mini-SWE-agent's ``LocalEnvironment`` with each command run in the sandbox of sandbox.py.

Selected through mini-SWE-agent's ordinary configuration (mini_swe.yaml)::

    environment:
      environment_class: mini_env.SandboxedEnvironment
      hide_paths: [...]

(run_agent.py puts this folder on mini-SWE-agent's PYTHONPATH). The agent, the model class and the rest of
mini-SWE-agent are unchanged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig
from sandbox import sandbox_available, sandboxed_command


class SandboxedEnvironmentConfig(LocalEnvironmentConfig):
    hide_paths: list[str] = []  # noqa: RUF012 (a pydantic field, copied per instance)
    """Paths replaced by an empty tmpfs for every command."""
    readonly_paths: list[str] | None = None
    """Paths mounted read-only (None: the Python installation)."""
    require_sandbox: bool = False
    """Refuse to run commands unsandboxed (instead of warning once)."""


class SandboxedEnvironment(LocalEnvironment):
    """mini-SWE-agent's LocalEnvironment; each command runs through ``sandboxed_command`` in its ``cwd``."""

    def __init__(self, **kwargs):
        super().__init__(config_class=SandboxedEnvironmentConfig, **kwargs)
        if not sandbox_available():
            if self.config.require_sandbox:
                raise RuntimeError("the sandbox (unshare with user/net/mount/pid namespaces) is not available")
            print("WARNING: unshare namespaces unavailable: agent commands run WITHOUT a sandbox", file=sys.stderr)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        keep = cwd or self.config.cwd or os.getcwd()
        command = sandboxed_command(action.get("command", ""), self.config.hide_paths, keep,
                                    self.config.readonly_paths)
        return super().execute(dict(action, command=command), cwd, timeout=timeout)
