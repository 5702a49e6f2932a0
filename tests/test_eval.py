"""``agl-trainer eval`` (issue 17): the held-out inputs through the real gateway, controller and a harness, with
the stand-in engine (tests/fakes.py); accuracy, pass@k and the reward distribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from agl_common.schemas import Rollout, RolloutStatus
from typer.testing import CliRunner

from agl_trainer.cli import app
from agl_trainer.config import TrainConfig
from agl_trainer.algorithm.evalstats import accuracy, eval_stats, pass_at_k, reward_mean
from agl_trainer.evaluation import PolicyNotFound, resolve_policy
from agl_trainer.tasks import default_is_correct
from fakes import Served, fake_upstream

pytestmark = pytest.mark.integrations
ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_k_by_hand():
    assert pass_at_k(2, 1, 1) == 0.5 and pass_at_k(2, 1, 2) == 1.0 and pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_one_accuracy_and_reward_definition():
    """A failed rollout that posted a reward before failing was counted correct by the training step's own
    accuracy (evaluations said wrong), and the two means differed; both use evalstats' definitions now."""
    rs = [Rollout(rollout_id="x0", status=RolloutStatus.failed, reward=1.0, failure="exit_code:1"),
          Rollout(rollout_id="x1", status=RolloutStatus.succeeded, reward=1.0),
          Rollout(rollout_id="x2", status=RolloutStatus.succeeded, reward=0.0),
          Rollout(rollout_id="x3", status=RolloutStatus.failed, failure="timeout")]
    assert accuracy(rs, default_is_correct) == 1 / 4 and reward_mean(rs) == 0.5
    s = eval_stats(rs, default_is_correct)
    assert (s["accuracy"], s["reward_mean"]) == (1 / 4, 0.5)
    assert accuracy([], default_is_correct) == 0.0 and reward_mean([]) == 0.0
    # round 15: the evaluation table's "reward mean ± std" (and eval.json's reward) took the failed rollout's
    # posted 1.0 (0.667, not 0.5); a step's group signal and per-role reward mean did too
    assert s["reward"]["mean"] == s["reward_mean"] == 0.5 and s["rewards"] == [None, 1.0, 0.0, None]
    from agl_common.schemas import CallRecord
    from agl_trainer.algorithm.stepstats import batch_signals, role_signals

    group = [r.model_copy(update={"group_id": "g"}) for r in rs[:3]]  # failed 1.0, succeeded 1.0 and 0.0
    assert batch_signals(group[:2], {})["group_signal_frac"] == 0.0  # only one outcome: 1.0
    assert batch_signals(group, {})["group_signal_frac"] == 1.0
    calls = {r.rollout_id: [CallRecord(rollout_id=r.rollout_id, attempt_id="0", seq=0, route="chat", request={},
                                       response={}, role="solver")] for r in rs}
    assert role_signals(rs, calls, [])["solver"]["reward_mean"] == 0.5


def test_eval_stats_by_hand():
    def r(g, i, status="succeeded", reward=None):
        return Rollout(rollout_id=f"{g}-{i}", group_id=g, status=RolloutStatus(status), reward=reward)

    rs = [r("a", 0, reward=1.0), r("a", 1, reward=1.0), r("a", 2, reward=0.0), r("a", 3, reward=0.0),
          r("b", 0, reward=0.0), r("b", 1, "failed"), r("b", 2, reward=1.0), r("b", 3, reward=0.5)]
    s = eval_stats(rs, default_is_correct)  # solved: reward >= 1
    assert s["accuracy"] == 3 / 8 and s["correct"] == [1, 1, 0, 0, 0, 0, 1, 0] and s["n"] == 8
    assert s["reward_mean"] == 3.5 / 7 and s["failed"] == 1 and s["problems"] == 2  # over the 7 that succeeded
    assert s["samples_per_problem"] == 4 and list(s["pass_at_k"]) == ["1", "2", "4"]
    # a: n=4, c=2 → pass@2 = 1 - C(2,2)/C(4,2) = 5/6; b: n=4, c=1 → 1 - C(3,2)/C(4,2) = 1/2
    assert s["pass_at_k"]["1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert s["pass_at_k"]["2"] == pytest.approx((5 / 6 + 1 / 2) / 2) and s["pass_at_k"]["4"] == 1.0
    assert s["reward"]["hist"] == {"0": 3, "0.5": 1, "1": 3} and s["reward"]["max"] == 1.0
    assert s["rewards"] == [1.0, 1.0, 0.0, 0.0, 0.0, None, 1.0, 0.5]
    import io

    from rich.console import Console

    from agl_trainer.evaluation import EvalPolicy, result_table

    out = io.StringIO()
    Console(file=out, width=200).print(result_table(s, EvalPolicy("policy-v2", 2)))
    text = out.getvalue()
    assert "held-out evaluation of policy-v2 (v2)" in text and "pass@4" in text and "0.375" in text
    assert "0: 3, 0.5: 1, 1: 3" in text


def test_policy_resolution(tmp_path):
    cfg = TrainConfig(out_dir=tmp_path / "runs")
    assert resolve_policy("base", cfg).model == "smollm2"
    for run in ("1201-000000-aaaa", "1201-000001-bbbb"):
        d = tmp_path / "runs" / run / "adapters" / "policy-v2"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
    p = resolve_policy("v2", cfg)
    assert (p.model, p.version) == ("policy-v2", 2) and p.adapter.parts[-3] == "1201-000001-bbbb"
    assert resolve_policy("v2", cfg, tmp_path / "runs" / "1201-000000-aaaa").adapter.parts[-3] == "1201-000000-aaaa"
    with pytest.raises(PolicyNotFound, match="no adapter policy-v3"):
        resolve_policy("v3", cfg)
    assert resolve_policy(str(p.adapter), cfg).model == "policy-v2"
    with pytest.raises(PolicyNotFound, match="not base, vN, or a directory"):
        resolve_policy(str(tmp_path), cfg)
    other = tmp_path / "my-adapter"  # an adapter directory of another name serves as eval-<name>, version 0
    other.mkdir()
    (other / "adapter_config.json").write_text("{}")
    assert (resolve_policy(str(other), cfg).model, resolve_policy(str(other), cfg).version) == ("eval-my-adapter", 0)


def test_one_policy_name():
    from agl_common.schemas import policy_name, policy_version

    assert policy_name(3) == "policy-v3" and policy_version("policy-v3") == 3
    assert [policy_version(n) for n in ("smollm2", "policy-v", "policy-v3x", "eval-policy-v3")] == [None] * 4


TASKS = '''
def heldout_problems():
    return [{"question": "3 + 4?", "answer": 7}, {"question": "1 + 1?", "answer": 2},
            {"question": "5 + 2?", "answer": 7, "flaky": True}]
'''


@pytest.mark.timeout(300)
def test_eval_command_runs_the_harness(tmp_path, redis_url, prefix):
    (tmp_path / "tasks.py").write_text(TASKS)
    with Served(fake_upstream(model="smollm2")) as engine:  # (the config's model_name: the engine must serve it)
        cfg = {"command": f"python {ROOT / 'tests' / 'harnesses' / 'eval_agent.py'}",
               "task_file": str(tmp_path / "tasks.py"), "eval_size": 10, "engine_url": engine.url,
               "redis_url": redis_url, "prefix": prefix, "out_dir": str(tmp_path / "runs"), "concurrency": 6,
               "rollout_timeout_s": 60, "loggers": ["console", "jsonl", "tensorboard"]}
        (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
        res = CliRunner().invoke(app, ["eval", str(tmp_path / "eval.yaml"), "--n", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # 3 problems x 2 samples: always right (2/2), never (0/2), flaky (1/2)
    assert out["n"] == 6 and out["problems"] == 3 and out["failed"] == 0
    assert out["accuracy"] == 0.5
    assert out["pass_at_k"] == {"1": pytest.approx(0.5), "2": pytest.approx(2 / 3)}
    assert out["reward"]["hist"] == {"0": 3, "1": 3} and sorted(out["rewards"]) == [0.0] * 3 + [1.0] * 3
    assert out["policy"] == "smollm2" and out["version"] == 0
    eval_dir = Path(out["eval_dir"])
    assert json.loads((eval_dir / "eval.json").read_text())["accuracy"] == 0.5
    (line,) = [json.loads(x) for x in (eval_dir / "metrics.jsonl").read_text().splitlines()]
    assert line["eval"] == "eval" and line["pass_at_k"]["2"] == pytest.approx(2 / 3)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(eval_dir / "tensorboard"))
    ea.Reload()
    assert [e.value for e in ea.Scalars("eval/accuracy")] == [0.5]


def test_eval_bad_input_is_clear(tmp_path):
    (tmp_path / "c.yaml").write_text(f"out_dir: {tmp_path / 'runs'}\n")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "c.yaml"), "--policy", "v4"])
    assert res.exit_code == 2 and "no adapter policy-v4" in res.output
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "c.yaml"), "--n", "0"])
    assert res.exit_code == 2 and "--n must be at least 1" in res.output


def test_policy_resolution_with_roles(tmp_path):
    """With roles, vN is each role's newest adapter at or below N (a role skipped at step N serves an older one)."""
    cfg = TrainConfig.model_validate({"out_dir": str(tmp_path / "runs"), "policy_serving": "adapter",
                                      "roles": {"solver": {"models": ["s"]}, "checker": {"models": ["c"]}}})
    run = tmp_path / "runs" / "1201-000000-aaaa"
    for name in ("policy-v1-solver", "policy-v1-checker", "policy-v2-solver", "policy-v3-checker"):
        (run / "adapters" / name).mkdir(parents=True)
        if name != "policy-v3-checker":  # v3's is half-written (no adapter_config.json): not an adapter
            (run / "adapters" / name / "adapter_config.json").write_text("{}")
    p = resolve_policy("v2", cfg)
    assert {r: n for r, (n, _) in p.roles.items()} == {"solver": "policy-v2-solver", "checker": "policy-v1-checker"}
    assert sorted(n for n, _ in p.adapters) == ["policy-v1-checker", "policy-v2-solver"]
    assert p.policy(cfg).roles == {"solver": "policy-v2-solver", "checker": "policy-v1-checker"}
    assert p.policy(cfg).role_models == {"s": "solver", "c": "checker"} and p.policy(cfg).version == 2
    base = resolve_policy("base", cfg)
    assert base.adapters == [] and base.policy(cfg).roles == {"solver": "smollm2", "checker": "smollm2"}
    with pytest.raises(PolicyNotFound, match="with roles, the policy is base or vN"):
        resolve_policy(str(run / "adapters" / "policy-v2-solver"), cfg)
    for beyond in ("v0", "v3", "v999999"):  # v0 has no adapter; v3 and later were never completed
        with pytest.raises(PolicyNotFound, match="no run reached version"):
            resolve_policy(beyond, cfg)
