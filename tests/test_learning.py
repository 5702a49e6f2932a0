"""The learning run's parts that need no engine: task splits, the step time split and signals, the
controller's warm-interpreter launcher, the run summary, bench/learning.py's arithmetic."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agl_common.schemas import CallRecord, Rollout, RolloutStatus

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "arithmetic" / "task.py"


def _task():
    spec = importlib.util.spec_from_file_location("arith_task", TASK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_splits_are_disjoint_and_heldout_is_large():
    task = _task()
    train, val, held = task.split()
    key = lambda p: (p["template"], p["a"], p["op"], p["b"])  # noqa: E731
    assert len(held) >= 200 and len(val) == 64 and len(train) >= 400
    assert not {*map(key, train)} & {*map(key, held)}
    assert not {*map(key, val)} & {*map(key, held)} and not {*map(key, train)} & {*map(key, val)}
    assert task.heldout_problems() == held  # fixed: the same problems in every run
    assert task.is_correct(held[0], 1.0) and not task.is_correct(held[0], 0.0) and not task.is_correct(held[0], None)


def test_is_correct_comes_from_the_task(tmp_path):
    from agl_trainer.tasks import default_is_correct, load_is_correct

    assert load_is_correct(TASK)({"answer": 3}, 1.0) is True
    plain = tmp_path / "plain.py"
    plain.write_text("def train(): return [{}]\n")
    assert load_is_correct(plain) is default_is_correct
    strict = tmp_path / "strict.py"
    strict.write_text("def is_correct(task, reward): return reward is not None and reward > 0.9\n")
    assert load_is_correct(strict)({}, 0.95) and not load_is_correct(strict)({}, 0.5)


def test_union_length():
    from agl_trainer.algorithm.stepstats import union_length

    assert union_length([], 0, 10) == 0
    assert union_length([(1, 3), (2, 5), (7, 8)], 0, 10) == 5
    assert union_length([(1, 3), (2, 5), (7, 8)], 2.5, 7.5) == 3.0  # clipped: 2.5-5 and 7-7.5
    assert union_length([(5, 4), (3, 3)], 0, 10) == 0  # inverted / empty intervals


def _rollout(rid, gid, start, end, reward=1.0):
    return Rollout(rollout_id=rid, group_id=gid, status=RolloutStatus.succeeded, started_at=start, ended_at=end,
                   reward=reward)


def _call(rid, seq, start, end, n=4, finish="stop"):
    return CallRecord(rollout_id=rid, attempt_id="0", seq=seq, route="chat", request={}, response={},
                      response_token_ids=list(range(n)), finish_reason=finish, started_at=start, ended_at=end)


def test_rollout_phase_split_partitions_the_phase():
    """Hand-built timeline (s): 10 rollouts start at 0; startup until 2; calls 2-6 (all); 9 end at 7, the last
    (straggler) ends at 20 after a call 12-19; the batch is ready at 21."""
    from agl_trainer.algorithm.stepstats import rollout_phase_split

    rollouts = [_rollout(f"r{i}", "g", 100.0, 107.0) for i in range(9)] + [_rollout("r9", "g", 100.0, 120.0)]
    calls = {f"r{i}": [_call(f"r{i}", 0, 102.0, 106.0)] for i in range(10)}
    calls["r9"].append(_call("r9", 1, 112.0, 119.0))
    t = rollout_phase_split(rollouts, calls, 100.0, 121.0)
    # 90 % of 10 = 9 rollouts ended at 107: the tail 107 → 121 is waiting for the straggler
    assert t["time_wait_s"] == pytest.approx(14.0)
    assert t["time_generation_s"] == pytest.approx(4.0)
    assert t["time_harness_startup_s"] == pytest.approx(2.0)
    assert t["time_idle_s"] == pytest.approx(1.0)  # 106 → 107: harnesses after their last call
    assert sum(t.values()) == pytest.approx(21.0)


def test_batch_signals():
    from agl_trainer.algorithm.stepstats import batch_signals

    rollouts = [_rollout("a0", "a", 0, 1, 1.0), _rollout("a1", "a", 0, 1, 0.0),
                _rollout("b0", "b", 0, 1, 1.0), _rollout("b1", "b", 0, 1, 1.0)]
    calls = {"a0": [_call("a0", 0, 0, 1, n=10, finish="length")], "a1": [_call("a1", 0, 0, 1, n=2)],
             "b0": [_call("b0", 0, 0, 1, n=4)], "b1": [_call("b1", 0, 0, 1, n=4, finish="length")]}
    s = batch_signals(rollouts, calls)
    assert s["group_signal_frac"] == 0.5 and s["truncation_rate"] == 0.5 and s["response_tokens_mean"] == 5.0


def test_time_split_totals():
    from agl_trainer.report import time_split_totals

    t = time_split_totals([{"step_s": 10.0, "time_generation_s": 6.0, "time_update_s": 3.0, "time_idle_s": 1.0},
                           {"step_s": 10.0, "time_generation_s": 4.0, "time_update_s": 5.0, "time_idle_s": 1.0}])
    assert t["time_generation_s"] == 10.0 and t["frac_generation"] == 0.5 and t["frac_update"] == 0.4
    assert t["frac_wait"] == 0.0


HARNESS = """
import atexit, json, os, sys
atexit.register(lambda: print("atexit ran"))
print(json.dumps({"argv": sys.argv[1:], "x": os.environ.get("X"), "cwd": os.getcwd(), "name": __name__,
                  "preloaded": "email.mime.text" in sys.modules}))
if sys.argv[1] == "sleep":
    import time; time.sleep(60)
sys.exit(int(sys.argv[1]))
"""

DRIVER = """
import asyncio, json, sys, time
from pathlib import Path
from agl_controller.spawn import Launcher, create_log

async def main(script, logs, preload):
    launcher = Launcher([sys.executable, script, "3"], preload)
    out = []
    for i, arg in enumerate(["3", "0"]):
        launcher.command[2] = arg
        proc = await launcher.start({"X": str(i)}, str(Path(script).parent), create_log(Path(logs) / f"{i}.log"))
        out.append(await proc.wait())
    launcher.command[2] = "sleep"
    proc = await launcher.start({"X": "s"}, None, create_log(Path(logs) / "s.log"))
    await asyncio.sleep(1.0)
    import os, signal
    os.killpg(proc.pid, signal.SIGKILL)
    out.append(await proc.wait())
    print(json.dumps(out))

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], [m for m in sys.argv[3:]]))
"""


@pytest.mark.parametrize("preload", [[], ["email.mime.text"]], ids=["exec", "preload"])
def test_launcher_runs_each_attempt_as_its_own_process(tmp_path, preload):
    """Exit codes, argv, environment, working directory, atexit hooks and log files are those of a fresh
    process in both modes; a killed process group reads as -SIGKILL; preload mode really pre-imports."""
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run = subprocess.run([sys.executable, str(driver), str(script), str(tmp_path), *preload], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [3, 0, -9]
    for i, code in enumerate(["3", "0"]):
        first, last = (tmp_path / f"{i}.log").read_text().strip().splitlines()
        seen = json.loads(first)
        assert seen["argv"] == [code] and seen["x"] == str(i) and seen["cwd"] == str(tmp_path)
        assert seen["name"] == "__main__" and seen["preloaded"] == bool(preload) and last == "atexit ran"


def test_launcher_refuses_what_it_cannot_fork(tmp_path):
    from agl_controller.spawn import LaunchError, Launcher, create_log

    with pytest.raises(LaunchError, match="no_such_module_xyz"):
        Launcher([sys.executable, "agent.py"], ["no_such_module_xyz"])
    with pytest.raises(LaunchError, match="same interpreter"):
        Launcher(["/usr/bin/python3", "agent.py"], ["json"])
    with pytest.raises(LaunchError, match="needs a Python command"):
        Launcher([sys.executable], ["json"])
    assert Launcher(["/bin/true"], []).mode == "exec"  # without preload any command is fine

    async def missing():
        await Launcher([sys.executable, "nope.py"], ["json"]).start({}, str(tmp_path), create_log(tmp_path / "x.log"))

    with pytest.raises(FileNotFoundError):
        asyncio.run(missing())


def test_controller_cli_rejects_a_bad_preload():
    run = subprocess.run([sys.executable, "-m", "agl_controller", "run", "--command", "/bin/true",
                          "--preload", "json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--preload" in run.stderr


def test_bench_learning_reads_finished_runs(tmp_path):
    """bench/learning.py --runs: per-seed lines, the mean gain and its standard error, a PNG."""
    runs = []
    for seed, (b, a) in enumerate([(0.1, 0.5), (0.1, 0.3)]):
        d = tmp_path / f"run{seed}"
        d.mkdir()
        curve = [{"minutes": 0.0, "step": 0, "when": "before", "accuracy": b, "n": 256, "subset_accuracy": b},
                 {"minutes": 10.0, "step": 8, "when": "after", "accuracy": a, "n": 256, "subset_accuracy": a}]
        (d / "summary.json").write_text(json.dumps({
            "run_dir": str(d), "seed": seed, "heldout_before": b, "heldout_after": a, "heldout_n": 256,
            "train_minutes": 10.0, "steps": 8, "curve": curve, "frac_generation": 0.6, "frac_update": 0.3}))
        runs.append(str(d))
    (tmp_path / "unfinished").mkdir()
    png = tmp_path / "curve.png"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--runs", *runs,
                          str(tmp_path / "unfinished"), "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gain +0.300 ± 0.100" in out.stdout and "0.100 → 0.400" in out.stdout
    assert "no summary.json" in out.stderr and png.stat().st_size > 1000


def test_bench_ablation_reads_finished_runs(tmp_path):
    """bench/ablation.py --runs: each run's arm from its config, per-arm mean ± standard error, the multi-row
    share, a PNG with accuracy and entropy against minutes."""
    runs = []
    for k, (arm, fields, seed, b, a) in enumerate([
            ("rollout", {}, 0, 0.1, 0.5), ("rollout", {}, 1, 0.1, 0.3),
            ("sample", {"advantage_level": "row", "loss_agg_mode": "seq-mean-token-mean"}, 0, 0.1, 0.2)]):
        d = tmp_path / f"run{k}"
        d.mkdir()
        curve = [{"minutes": 0.0, "step": 0, "when": "before", "accuracy": b, "n": 256, "subset_accuracy": b},
                 {"minutes": 2.0, "step": 2, "when": "after", "accuracy": a, "n": 256, "subset_accuracy": a}]
        (d / "summary.json").write_text(json.dumps({
            "run_dir": str(d), "seed": seed, "heldout_before": b, "heldout_after": a, "heldout_n": 256,
            "train_minutes": 2.0, "steps": 2, "curve": curve, "hardware": {"model": "Some CPU"}}))
        (d / "config.json").write_text(json.dumps({"seed": seed, **fields}))
        steps = [{"step": i, "reward_mean": 0.2, "step_s": 60.0, "entropy": 1.5 - 0.1 * i, "rollouts_trained": 60,
                  "multi_row_rollouts": 20} for i in (1, 2)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in steps) + "\n")
        runs.append(str(d))
    png = tmp_path / "ablation.png"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ablation.py"), "--runs", *runs, "--png", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rollout: 2 seed(s), held-out 0.100 ± 0.000 → 0.400 ± 0.100, gain +0.300 ± 0.100" in out.stdout
    assert "sample: 1 seed(s)" in out.stdout and "gain +0.100 ± 0.000" in out.stdout
    assert "40/120" in out.stdout and "Some CPU" in out.stdout and png.stat().st_size > 1000
    # --study roles: the same runs read as the shared-vs-per-role comparison (a config with roles is per-role)
    (tmp_path / "run2" / "config.json").write_text(json.dumps({"seed": 0, "roles": {"solver": {"models": ["s"]}}}))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ablation.py"), "--study", "roles", "--runs", *runs,
                          "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "shared: 2 seed(s)" in out.stdout and "per-role: 1 seed(s)" in out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "ablation.py"), "--study", "roles", "--arms", "sample"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "shared, per-role" in bad.stderr


def test_piped_cli_prints_no_progress_bars():
    """Output to a pipe: the entry point switches tqdm off before anything imports it (a bar redrawn with ``\\r``
    would land in a log as one huge line, as the GGUF conversion's did)."""
    code = ("import sys; sys.argv = ['agl-trainer', '--help']\n"
            "from agl_trainer.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "from tqdm.auto import tqdm\n"
            "for _ in tqdm(range(3), desc='converting'):\n    pass\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "Usage" in out.stdout
    assert "converting" not in out.stderr and "\r" not in out.stderr


@pytest.mark.parametrize("bad", ["steps: -1", "group_size: 0", "groups_per_step: 0", "lr: -1", "lr: .nan",
                                 "seed: 1180591620717411303424", "eval_size: -5", "concurrency: 0",
                                 "min_group_size: 0", "min_group_size: 9\ngroup_size: 8", "micro_batch_tokens: 0",
                                 "rollout_timeout_s: -1", "clip_c: 0.5", "steps: [", "engine_url: notaurl",
                                 "engine_url: http://h:99999"])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_config_out_of_range_is_a_usage_error_before_anything_starts(bad, command, tmp_path, monkeypatch):
    """Nonsense sizes (and a file that is not YAML) used to pass, and a run started the engine and the whole
    stack before failing (or never trained a group): exit 2 with the field named, nothing run."""
    from typer.testing import CliRunner

    from agl_trainer import cli

    ran = []
    monkeypatch.setattr(cli, "_run", lambda cfg, resume=None: ran.append(cfg))
    config = tmp_path / "c.yaml"
    config.write_text(bad + "\n")
    result = CliRunner().invoke(cli.app, [command, str(config)])
    assert result.exit_code == 2, (bad, result.output, result.exception)
    field = bad.split(":")[0] if "[" not in bad else "YAML"
    assert field in result.output.replace("\n", " "), result.output
    assert ran == []


@pytest.mark.parametrize("args", [["--input", '{"a": NaN}'], ["--input", '{"a": 1e999}'],
                                  ["--input", '{"a": [1, {"b": -Infinity}]}'], ["--input", "{}", "--n", "0"],
                                  ["--input", "[1]"], ["--input", "{}", "--id", "a b"],
                                  ["--input", "{}", "--id", "x{y}"],
                                  ["--input", "{}", "--id", "r" * 300]])
def test_rollouts_create_refuses_what_it_would_store_changed_or_not_at_all(args, redis_url, prefix):
    """``NaN`` / ``1e999`` used to be stored as null, ``--n 0`` to exit 0 having created nothing, and any
    string to be a rollout id (a space, a hash-tag brace, 300 characters)."""
    import redis as redis_sync
    from typer.testing import CliRunner

    from agl_trainer import cli

    result = CliRunner().invoke(cli.app, ["rollouts", "create", *args, "--redis", redis_url, "--prefix", prefix])
    assert result.exit_code == 2 and "No such option" not in result.output, result.output
    assert list(redis_sync.Redis.from_url(redis_url).scan_iter(match=prefix + "*")) == []
    ok = CliRunner().invoke(cli.app, ["rollouts", "create", "--input", '{"a": 1.5}', "--redis", redis_url,
                                      "--prefix", prefix])
    assert ok.exit_code == 0, ok.output


def test_an_error_that_quotes_brackets_is_printed_as_written(redis_url, prefix):
    """Error text is not Rich markup: an id or message holding ``[/...]`` used to crash the CLI (MarkupError,
    exit 1) instead of printing the error."""
    from typer.testing import CliRunner

    from agl_trainer import cli

    result = CliRunner().invoke(cli.app, ["rollouts", "create", "--input", "{}", "--id", "[/red] x",
                                          "--redis", redis_url, "--prefix", prefix])
    assert result.exit_code == 2 and "[/red] x" in result.output, (result.output, result.exception)
    shown = CliRunner().invoke(cli.app, ["rollouts", "show", "[/bold]", "--redis", redis_url, "--prefix", prefix])
    # (no rollout id holds "[": a usage error, exit 2, printed as written)
    assert shown.exit_code == 2 and "'[/bold]'" in shown.output, (shown.output, shown.exception)


@pytest.mark.parametrize("url,code,says", [("redis://127.0.0.1:1/0", 1, "Redis did not answer"),
                                           ("redis+cluster://", 2, "invalid --redis")])
def test_an_unreachable_or_malformed_redis_is_one_line_not_a_traceback(url, code, says):
    env = {"PYTHONPATH": ":".join(str(ROOT / "packages" / p / "src")
                                  for p in ("common", "gateway", "controller", "trainer")), "PATH": "/usr/bin:/bin"}
    for args in (["rollouts", "list"], ["rollouts", "create", "--input", "{}"], ["gateway", "status"]):
        proc = subprocess.run([sys.executable, "-m", "agl_trainer", *args, "--redis", url], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == code and says in proc.stderr, (args, proc.returncode, proc.stderr[-800:])
        assert "Traceback" not in proc.stderr
