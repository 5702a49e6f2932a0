"""The collocated cycle against the Backend interface (agl_trainer.cycle.backend_cycle), on a real Redis."""

from __future__ import annotations

import pytest
from agl_common.schemas import Policy
from agl_trainer.backends.base import Backend
from agl_trainer.cycle import backend_cycle


class RecordingBackend:
    """A backend that records the calls made to it (the engine side is the part under test elsewhere)."""

    name = "recording"

    def __init__(self, fail_in: str | None = None):
        self.calls: list[tuple] = []
        self.fail_in = fail_in

    def update(self, rows, row_advantages):
        self.calls.append(("update", len(rows), list(row_advantages)))
        if self.fail_in == "update":
            raise RuntimeError("update failed")
        return {"loss": 0.5, "grad_norm": 1.0, "clip_frac": 0.0, "ratio_mean": 1.0, "update_s": 0.0}

    async def publish(self, version):
        self.calls.append(("publish", version))
        if self.fail_in == "publish":
            raise RuntimeError("publish failed")
        return Policy(model=f"served-v{version}", version=version)

    async def serve(self, version):
        return Policy(model=f"served-v{version}", version=version)

    async def retire(self, version):
        self.calls.append(("retire", version))

    def checkpoint(self, path):
        pass

    def restore(self, path):
        pass


def test_both_backends_have_the_interface():
    from agl_trainer.backends.cpu import CpuBackend
    from agl_trainer.backends.verl.trainer import VerlBackend

    for cls in (CpuBackend, VerlBackend):
        for method in ("update", "publish", "serve", "retire", "checkpoint", "restore"):
            assert callable(getattr(cls, method, None)), (cls, method)
    assert isinstance(RecordingBackend(), Backend)


async def test_cycle_updates_publishes_then_resumes_on_the_new_version(store):
    backend = RecordingBackend()
    stats = await backend_cycle(store, backend, 3, ["row-a", "row-b"], [1.0, -1.0], drain_timeout_s=5)
    assert backend.calls == [("update", 2, [1.0, -1.0]), ("publish", 3), ("retire", 2)]
    assert [e[0] for e in stats["cycle_events"]] == ["pause", "drained", "resume"]
    assert stats["loss"] == 0.5 and stats["replicas"] == 0
    last = await store.last_control()
    assert last.cmd == "resume" and last.model == "served-v3" and last.version == 3


@pytest.mark.parametrize("where", ["update", "publish"])
async def test_a_failed_cycle_resumes_the_old_policy(store, where):
    backend = RecordingBackend(fail_in=where)
    with pytest.raises(RuntimeError, match=f"{where} failed"):
        await backend_cycle(store, backend, 2, ["row"], [1.0], drain_timeout_s=5)
    last = await store.last_control()
    assert last.cmd == "resume" and last.model is None and last.version is None
    assert ("retire", 1) not in backend.calls
