"""Rollout-scoped API keys, derived with HMAC-SHA256 from the gateway's admin key (never stored).

A scoped key authorizes model calls, rewards and events of exactly one rollout attempt.
"""

from __future__ import annotations

import hashlib
import hmac

SCOPED_PREFIX = "agl-"


def scoped_key(secret: str, rollout_id: str, attempt_id: str) -> str:
    """Key for one rollout attempt: ``agl-`` + hex HMAC-SHA256(secret, rollout_id NUL attempt_id)[:40]."""
    mac = hmac.new(secret.encode(), f"{rollout_id}\0{attempt_id}".encode(), hashlib.sha256)
    return SCOPED_PREFIX + mac.hexdigest()[:40]


def key_allows(secret: str, presented: str | None, rollout_id: str | None, attempt_id: str | None) -> bool:
    """True if ``presented`` is the admin key, or the scoped key of this rollout attempt.

    Comparisons are constant-time (``hmac.compare_digest``) on UTF-8 bytes: a presented key with characters
    outside ASCII (a header's Latin-1 text) is simply not equal, never a ``TypeError``.
    """
    if not presented:
        return False
    given = presented.encode("utf-8", "surrogatepass")
    if hmac.compare_digest(given, secret.encode()):
        return True
    if rollout_id is None or attempt_id is None:
        return False
    return hmac.compare_digest(given, scoped_key(secret, rollout_id, attempt_id).encode())
