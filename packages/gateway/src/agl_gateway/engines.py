"""Several upstream engines: each rollout is pinned to one (prefix-cache reuse); unhealthy ones are skipped.

Pinning is rendezvous hashing (Thaler & Ravishankar 1998, "highest random weight"): a rollout goes to
the healthy engine with the highest ``blake2b(rollout_id, engine)``; when an engine goes down only
its rollouts move, and they come back when it recovers.
"""

from __future__ import annotations

import hashlib
import time


class NoEngine(RuntimeError):
    """Every configured engine is marked down."""


class Engines:
    """The engine base URLs (each ending in ``/v1``) and which are down until when (monotonic seconds)."""

    def __init__(self, urls: list[str], down_for_s: float = 5.0):
        if not urls:
            raise ValueError("at least one upstream engine is required")
        self.urls = urls
        self.down_for_s = down_for_s
        self._down_until: dict[str, float] = {}

    def healthy(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.urls if self._down_until.get(u, 0.0) <= now]

    def pick(self, rollout_id: str, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """The engine for ``rollout_id`` among healthy engines not in ``exclude``; raises :class:`NoEngine`."""
        candidates = [u for u in self.healthy() if u not in exclude]
        if not candidates:
            raise NoEngine("no healthy upstream engine")
        if len(candidates) == 1:
            return candidates[0]
        return max(candidates, key=lambda u: hashlib.blake2b(f"{rollout_id}\0{u}".encode(), digest_size=8).digest())

    def mark_down(self, url: str) -> None:
        """Skip ``url`` for ``down_for_s`` seconds (after a connection failure)."""
        self._down_until[url] = time.monotonic() + self.down_for_s
