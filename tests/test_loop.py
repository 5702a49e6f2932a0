"""The whole run loop in seconds: the real gateway, controller and harness processes on the shared fake engine,
a backend that records what it is given (no model, no vLLM): set-up, the evaluations, steps, the checkpoint,
a resume, the summary."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from agl_common.schemas import Policy
from agl_trainer.checkpoint import load_checkpoint
from agl_trainer.config import TrainConfig
from agl_trainer.loop import train_async
from agl_trainer.services import Services
from agl_trainer.stack import start_agents
from rich.console import Console

from fakes import Served, fake_upstream

ROOT = Path(__file__).resolve().parent.parent

TASKS = '''
def train_problems():  # "flaky": rollout i of a group is right only for even i, so every group has a signal
    return [{"question": "3 + 4?", "answer": 7, "flaky": True}] * 8

def heldout_problems():
    return [{"question": "3 + 4?", "answer": 7}, {"question": "1 + 1?", "answer": 2},
            {"question": "5 + 2?", "answer": 7}]
'''


class RecordingBackend:
    """A :class:`agl_trainer.backends.base.Backend` that trains nothing and remembers every call."""

    name = "recording"

    def __init__(self, model: str):
        self.model, self.updates, self.published, self.served, self.restored = model, [], [], [], []

    def update(self, rows, row_advantages):
        self.updates.append((rows, list(row_advantages)))
        return {"loss": 0.5, "grad_norm": 1.0, "clip_frac": 0.0, "ratio_mean": 1.0, "ratio_first": 1.0,
                "clip_frac_first": 0.0, "kl": 0.0, "update_s": 0.01}

    async def publish(self, version):
        self.published.append(version)
        return Policy(model=self.model, version=version)

    async def serve(self, version):
        self.served.append(version)
        return Policy(model=self.model, version=version)

    async def retire(self, version):
        pass

    def checkpoint(self, path):
        path.mkdir(parents=True)
        (path / "weights.json").write_text(json.dumps({"updates": len(self.updates)}))

    def restore(self, path):
        self.restored.append(json.loads((path / "weights.json").read_text()))


@pytest.mark.timeout(300)
def test_the_loop_trains_evaluates_checkpoints_and_resumes(tmp_path, redis_url, prefix):
    (tmp_path / "tasks.py").write_text(TASKS)
    cfg = TrainConfig(command=f"python {ROOT / 'tests' / 'harnesses' / 'eval_agent.py'}",
                      task_file=str(tmp_path / "tasks.py"), train_fn="train_problems", heldout_fn="heldout_problems",
                      steps=2, groups_per_step=2, group_size=2, eval_size=3, eval_subset=2, eval_every=1,
                      concurrency=8, rollout_timeout_s=60, preload=[], redis_url=redis_url, prefix=prefix,
                      out_dir=str(tmp_path / "runs"), loggers=["console", "jsonl"])
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    out = io.StringIO()
    console = Console(file=out, width=200)
    with Served(fake_upstream()) as engine, Services(run_dir / "logs") as svc:
        start_agents(svc, cfg, engine.url, redis_url, cfg.model_name, run_dir / "logs" / "rollouts")
        backend = RecordingBackend(cfg.model_name)
        summary = asyncio.run(train_async(cfg, run_dir, console, redis_url, None, backend))

        # two steps, each on 2 groups x 2 rollouts: rewards (1, 0) in every group, GRPO +-1/sqrt(2)
        assert summary["steps"] == 2 and summary["policy_version"] == 2 and backend.published == [1, 2]
        for rows, adv in backend.updates:
            assert len(rows) == 4 and adv == pytest.approx([0.7071, -0.7071] * 2, abs=1e-3)
        # the engine always answers 7: "1 + 1?" is wrong under every policy
        assert summary["heldout_before"] == summary["heldout_after"] == pytest.approx(2 / 3)
        assert summary["heldout_n"] == 3
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in lines if "eval" not in m and "step" in m]
        evals = [(m["eval"], m["step"]) for m in lines if m.get("eval")]
        assert [m["step"] for m in steps] == [1, 2] and evals == [("before", 0), ("during", 1), ("after", 2)]
        assert steps[0]["reward_mean"] == 0.5 and steps[0]["accuracy"] == 0.5 and steps[1]["policy_version"] == 2
        assert load_checkpoint(run_dir)["step"] == 2 and (run_dir / "summary.json").exists()
        assert "step 2: reward 0.50" in out.getvalue() and "held-out accuracy: before 0.667 → after 0.667" in \
            out.getvalue()

        # resumed with one more step allowed: restored, served again, step 3 only, the summary covers all three
        more = cfg.model_copy(update={"steps": 3})
        resumed = RecordingBackend(cfg.model_name)
        summary = asyncio.run(train_async(more, run_dir, console, redis_url, load_checkpoint(run_dir), resumed))
    assert resumed.restored == [{"updates": 2}] and resumed.served == [2] and resumed.published == [3]
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval" not in m and "step" in m] == [1, 2, 3]
    assert "resumed r1 after step 2 (policy v2" in out.getvalue()


def test_a_bad_task_file_stops_the_loop_before_anything_runs(tmp_path, redis_url, prefix):
    from agl_trainer.tasks import TaskError

    (tmp_path / "tasks.py").write_text("def heldout_problems():\n    return []\n")
    cfg = TrainConfig(task_file=str(tmp_path / "tasks.py"), train_fn="train_problemz", redis_url=redis_url,
                      prefix=prefix, out_dir=str(tmp_path / "runs"))
    backend = RecordingBackend(cfg.model_name)
    with pytest.raises(TaskError, match="no function 'train_problemz'"):
        asyncio.run(train_async(cfg, tmp_path, Console(file=io.StringIO()), redis_url, None, backend))
    assert backend.updates == [] and backend.served == [] and not (tmp_path / "metrics.jsonl").exists()
