"""AGL common: schemas, Redis layout, settings and the control protocol."""

from .schemas import CallRecord, ControlCommand, Policy, ReplicaStatus, Rollout, RolloutStatus
from .settings import CommonSettings
from .store import RolloutNotFound, Store

__all__ = [
    "CallRecord",
    "CommonSettings",
    "ControlCommand",
    "Policy",
    "ReplicaStatus",
    "Rollout",
    "RolloutNotFound",
    "RolloutStatus",
    "Store",
]
