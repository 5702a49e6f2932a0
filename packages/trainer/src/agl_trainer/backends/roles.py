"""A policy per sub-agent: one :class:`agl_trainer.backends.cpu.CpuBackend` (its own LoRA, its own optimizer) per
role of a multi-agent harness, behind the one :class:`agl_trainer.backends.base.Backend` shape the loop knows.

- **update**: the step's rows are split by :attr:`Row.role`; each role's backend takes one update on its own rows
  with their advantages as given (the advantage stays per rollout: every row of a rollout, whatever its role, has
  the rollout's advantage), so the loss is normalized per rollout *within each role's batch*. A role with no rows
  in the step is skipped and counted (``roles_skipped``); rows of no known role are dropped and counted
  (``rows_without_role``).
- **publish**: every updated role's adapter is saved and hot-loaded as ``policy-v{N}-{role}``; the returned
  :class:`Policy` routes every role at once (one version for the step); a skipped role keeps serving what it
  served (its adapter is not published anew).
- **checkpoint / restore**: each role's weights and optimizer in ``{path}/{role}``, and the version each role
  served in ``{path}/served.json`` (:data:`SERVED_FILE`).
- **serve** (a resumed run): after :meth:`RolesBackend.restore`, each role serves the adapter it served at the
  checkpoint (a missing one is an error, never an older one in silence); before it (or from a checkpoint written
  without ``served.json``), its newest saved adapter at or below the version, or the base model.

Each role holds its own copy of the base model in memory (a 135M-parameter model: ~0.5 GB in fp32 per role).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agl_common.schemas import Policy, policy_name, policy_version

from ..files import read_small_file

#: The file in a roles checkpoint that says which version each role served (role → version, 0: the base model).
SERVED_FILE = "served.json"

#: stats averaged over the updated roles (weighted by their rows); the other numeric stats are summed
MEAN_STATS = ("loss", "grad_norm", "clip_frac", "ratio_mean", "ratio_first", "clip_frac_first", "entropy", "kl")


class RolesBackend:
    """One LoRA policy per role (:mod:`agl_trainer.backends.roles`).

    Args:
        backends: role → its backend (a :class:`~agl_trainer.backends.cpu.CpuBackend` built with ``role=`` and
            ``serving="adapter"``).
        base: the base policy (:meth:`agl_trainer.config.TrainConfig.base_policy`): its model name serves a role
            until the role is first updated; its ``role_models`` are how the gateway recognizes each role.
    Raises:
        ValueError: ``backends`` and ``base.roles`` name different roles.
    """

    name = "cpu"

    def __init__(self, backends: dict[str, Any], base: Policy):
        if set(backends) != set(base.roles) or not backends:
            raise ValueError(f"backends for roles {sorted(backends)} but the policy has roles {sorted(base.roles)}")
        self.backends, self.base = backends, base
        self.served_version = {role: 0 for role in backends}  # the version each role's adapter was published at
        self.restored: dict[str, int] | None = None  # what each role served at the restored checkpoint
        self.updated: list[str] = []
        self.to_retire: dict[str, int] = {}

    def policy(self, version: int) -> Policy:
        """The policy that routes each role to what it serves now, as ``version``."""
        return self.base.model_copy(update={"version": version, "roles": {
            role: policy_name(v, role) if v else self.base.model for role, v in self.served_version.items()}})

    def update(self, rows: list, row_advantages: list[float]) -> dict[str, Any]:
        """One update per role on its rows (:class:`agl_trainer.algorithm.aggregate.Row`, ``role`` set).

        Returns the stats of :meth:`CpuBackend.update` merged over the updated roles (:data:`MEAN_STATS`
        weighted by rows, counts and ``update_s`` summed), ``roles`` (role → its own stats and ``rows``),
        ``roles_skipped`` (roles without rows) and ``rows_without_role``. Raises ``KeyboardInterrupt`` as
        the role's update does (the roles after it are not updated).
        """
        by_role: dict[str, list[int]] = {role: [] for role in self.backends}
        orphans = 0
        for i, row in enumerate(rows):
            if row.role in by_role:
                by_role[row.role].append(i)
            else:
                orphans += 1
        per_role: dict[str, dict] = {}
        for role, idx in by_role.items():
            if idx:
                st = self.backends[role].update([rows[i] for i in idx], [row_advantages[i] for i in idx])
                per_role[role] = {**st, "rows": len(idx)}
        self.updated = list(per_role)
        out: dict[str, Any] = {"roles": per_role, "roles_skipped": [r for r in by_role if r not in per_role],
                               "rows_without_role": orphans}
        n = sum(s["rows"] for s in per_role.values())
        for key in MEAN_STATS:
            vals = [(s[key], s["rows"]) for s in per_role.values() if isinstance(s.get(key), (int, float))]
            out[key] = sum(v * w for v, w in vals) / max(1, sum(w for _, w in vals)) if vals else 0.0
        for key in ("train_tokens", "updates", "dropped_rollouts", "dropped_rows", "update_s"):
            out[key] = sum(s.get(key, 0) for s in per_role.values())
        out["update_rows"] = n
        return out

    async def publish(self, version: int) -> Policy:
        """Save and hot-load every role updated by the last :meth:`update` as ``policy-v{version}-{role}``; the
        policy returned routes each role to its newest adapter (the others unchanged)."""
        retire = {}
        for role in self.updated:
            await self.backends[role].publish(version)
            if self.served_version[role]:
                retire[role] = self.served_version[role]
            self.served_version[role] = version
        self.to_retire, self.updated = retire, []
        return self.policy(version)

    async def serve(self, version: int) -> Policy:
        """Each role serves what it served at the restored checkpoint (:meth:`restore`), else its newest adapter
        saved at or below ``version`` (the base model without one). Raises ``FileNotFoundError`` if a restored
        role's adapter is missing or newer than ``version``."""
        for role, backend in self.backends.items():
            if self.restored is None:
                v = newest_saved(backend.out_dir, role, version)
            else:
                v = self.restored[role]
                if why := adapter_missing(backend.out_dir, role, v if v <= version else None):
                    raise FileNotFoundError(why)
            if v:
                await backend.serve(v)
            self.served_version[role] = v
        return self.policy(version)

    async def retire(self, version: int) -> None:
        """Unload the adapters the last :meth:`publish` replaced (``version`` itself is not needed: a role
        skipped at a step still serves an older version)."""
        for role, v in self.to_retire.items():
            await self.backends[role].retire(v)
        self.to_retire = {}

    def checkpoint(self, path: Path) -> None:
        """Each role's LoRA weights and optimizer state under ``{path}/{role}``; the version each serves in
        ``{path}/served.json``."""
        for role, backend in self.backends.items():
            backend.checkpoint(Path(path) / role)
        (Path(path) / SERVED_FILE).write_text(json.dumps(self.served_version))

    def restore(self, path: Path) -> None:
        """Load what :meth:`checkpoint` wrote; ``FileNotFoundError`` if a role's part is missing, ``ValueError`` if
        its ``served.json`` is not one (a checkpoint written before it existed has none: :meth:`serve` then takes
        each role's newest saved adapter)."""
        self.restored = served_at(Path(path), list(self.backends))
        for role, backend in self.backends.items():
            backend.restore(Path(path) / role)
        if self.restored is not None:
            self.served_version = dict(self.restored)


def saved_versions(out_dir: Path, role: str) -> list[int]:
    """The versions of ``role`` with a complete adapter saved in ``out_dir`` (``policy-v{v}-{role}`` holding
    ``adapter_config.json``: a directory left half-written by a kill is not one), ascending."""
    return sorted(v for p in Path(out_dir).glob(f"policy-v*-{role}")
                  if (v := policy_version(p.name)) is not None and p.name == policy_name(v, role)
                  and (p / "adapter_config.json").is_file())


def newest_saved(out_dir: Path, role: str, version: int) -> int:
    """The newest version ``v <= version`` of :func:`saved_versions` (0: none, the base model)."""
    return max((v for v in saved_versions(out_dir, role) if v <= version), default=0)


def served_at(checkpoint: Path, roles: list[str]) -> dict[str, int] | None:
    """The version each of ``roles`` served when ``checkpoint`` was written (its :data:`SERVED_FILE`), or None if
    it has none. Raises ``ValueError`` (one line) if the file cannot be read or does not give every role, and no
    other, a version (a non-negative integer)."""
    path = Path(checkpoint) / SERVED_FILE
    if not path.exists():
        return None
    try:
        served = json.loads(read_small_file(path, 1 << 20))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not (isinstance(served, dict) and sorted(served) == sorted(roles)
            and all(type(v) is int and v >= 0 for v in served.values())):
        raise ValueError(f"{path} does not give each of the roles {', '.join(sorted(roles))} a version")
    return served


def missing_served(run_dir: Path, roles: list[str]) -> str | None:
    """Why the run at ``run_dir`` cannot serve what its roles served at its checkpoint (:func:`served_at`): a
    role's adapter missing from ``adapters/``, or ``served.json`` unreadable; None if nothing is missing."""
    try:
        served = served_at(Path(run_dir) / "checkpoint", roles)
    except ValueError as exc:
        return str(exc)
    for role, v in sorted((served or {}).items()):
        if why := adapter_missing(Path(run_dir) / "adapters", role, v):
            return why
    return None


def adapter_missing(out_dir: Path, role: str, version: int | None) -> str | None:
    """Why ``role`` cannot serve ``version`` (what it served at a checkpoint) from ``out_dir``: no complete
    adapter :func:`saved_versions` has (version None: one newer than the checkpoint's); None if it can (version 0,
    the base model, always can)."""
    if version == 0 or (version is not None and version in saved_versions(out_dir, role)):
        return None
    what = policy_name(version, role) if version is not None else "a version newer than the checkpoint's"
    return f"role {role} served {what} at the checkpoint, but {out_dir} holds no such adapter"
