"""Tasks in the SWE-smith / SWE-bench shape: working copies, test runs, grading and cleaning.

A task (one JSON object; ``make_tasks.py`` writes and loads them) holds:

==================  ==========================================================================================
``instance_id``     unique name
``format``          ``generated`` or ``swe-smith`` (clean snapshot + ``bug_patch`` = buggy code), or
                    ``swe-bench`` (``base_commit`` = buggy code, ``gold_patch`` fixes it, ``test_patch`` adds the
                    hidden tests)
``repo``            the repository snapshot: a directory, a ``.tar.gz``, or (``base_commit`` set) a local git
                    clone; a relative path is resolved against this folder (examples/swe)
``problem_statement`` the issue text the agent sees
``FAIL_TO_PASS``    pytest node ids that fail on the buggy code and must pass after the fix
``PASS_TO_PASS``    pytest node ids that pass on both and must keep passing
==================  ==========================================================================================

Guards (each has a test in tests/test_swe.py):

- the agent's working copy (``prepare_workspace``) is a fresh ``git init`` snapshot of the buggy code: no history,
  so no fix to find in ``git log``; the files of the FAIL_TO_PASS tests are removed from it;
- grading (``evaluate``) starts from a fresh copy of the buggy code *with* every original test file, applies the
  agent's diff minus every entry that touches a protected path (tests, ``conftest.py``, pytest/packaging
  configuration, ``sitecustomize``/``.pth``), leaves the repository (absolute paths, ``..``, ``.git/``) or is a
  symlink; those entries are reported in ``dropped`` and never applied;
- the tests run with ``python -s`` (no user site-packages), a minimal environment (no rollout key, no reward URL),
  a timeout, and, where available, in the sandbox of ``sandbox.py`` (no network); outcomes are read from a
  per-test report written by a pytest plugin, not from the exit code or printed text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sandbox

IGNORE = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.pyc")
#: file names whose changes the grader never applies (they can change how tests run or what they see)
PROTECTED_NAMES = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py",
                   "sitecustomize.py", "usercustomize.py", ".coveragerc"}
TEST_DIRS = {"test", "tests", "testing"}

PLUGIN = '''
import json, os
_results = {}
def pytest_runtest_logreport(report):
    prev = _results.get(report.nodeid, "passed")
    if report.failed:
        _results[report.nodeid] = "failed"
    elif report.skipped and prev != "failed":
        _results[report.nodeid] = "skipped"
    elif report.when == "call" and prev != "failed":
        _results[report.nodeid] = "passed" if prev != "skipped" else prev
def pytest_collectreport(report):
    if report.failed:
        _results[report.nodeid or "<collection>"] = "error"
def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["AGL_SWE_REPORT"], "w") as f:
        json.dump(_results, f)
'''


# ------------------------------------------------------------------ paths and snapshots
def resolve_repo(repo: str) -> Path:
    path = Path(repo)
    return path if path.is_absolute() else HERE / path


def test_file(node_id: str) -> str:
    """``tests/test_a.py::TestX::test_y[1]`` -> ``tests/test_a.py``."""
    return node_id.split("::", 1)[0]


def hidden_test_files(task: dict) -> list[str]:
    """Files of the FAIL_TO_PASS tests: removed from the agent's working copy, restored for grading."""
    return sorted({test_file(t) for t in task["FAIL_TO_PASS"]})


def _git(args: list[str], cwd: Path, input_text: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "agl", "GIT_AUTHOR_EMAIL": "agl@localhost", "GIT_COMMITTER_NAME": "agl",
           "GIT_COMMITTER_EMAIL": "agl@localhost", "LC_ALL": "C"}
    return subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "safe.directory=*", *args], cwd=cwd,
                          input=input_text, capture_output=True, text=True, env=env, check=check)


def _copy_snapshot(task: dict, dest: Path) -> None:
    src = resolve_repo(task["repo"])
    dest.mkdir(parents=True, exist_ok=True)
    if task.get("base_commit"):  # a local git clone: export the tree at base_commit, without history
        archive = subprocess.run(["git", "-C", str(src), "archive", "--format=tar", task["base_commit"]],
                                 capture_output=True, check=True)
        with tarfile.open(fileobj=__import__("io").BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="data")
    elif src.is_file() and src.name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(src) as tar:
            tar.extractall(dest, filter="data")
        entries = list(dest.iterdir())
        if len(entries) == 1 and entries[0].is_dir():  # an archive with one top folder: use its content
            for child in list(entries[0].iterdir()):
                child.rename(dest / child.name)
            entries[0].rmdir()
    else:
        shutil.copytree(src, dest, ignore=IGNORE, dirs_exist_ok=True)


def apply_patch(repo: Path, patch: str | None) -> None:
    """``git apply`` in ``repo`` (made a git repository if it is not one), raising on failure."""
    if not patch or not patch.strip():
        return
    if not (repo / ".git").exists():
        _git(["init", "-q"], repo)
    proc = _git(["apply", "--whitespace=nowarn", "-"], repo, input_text=patch, check=False)
    if proc.returncode != 0:
        raise PatchError(proc.stderr.strip())


class PatchError(RuntimeError):
    pass


def materialize(task: dict, dest: Path, state: str = "buggy", with_tests: bool = True) -> Path:
    """The repository in ``state`` ``buggy`` (what the agent starts from) or ``gold`` (fixed), at ``dest``.

    ``with_tests``: apply a SWE-bench ``test_patch`` (the hidden tests). ``dest`` has no ``.git`` afterwards.
    """
    dest = Path(dest)
    _copy_snapshot(task, dest)
    if task.get("format") == "swe-bench":
        if state == "gold":
            apply_patch(dest, task.get("gold_patch"))
    elif state == "buggy":
        apply_patch(dest, task.get("bug_patch"))
    if with_tests:
        apply_patch(dest, task.get("test_patch"))
    shutil.rmtree(dest / ".git", ignore_errors=True)
    return dest


def prepare_workspace(task: dict, dest: Path) -> Path:
    """The agent's working copy: buggy code, FAIL_TO_PASS test files removed, one commit in a fresh repository."""
    dest = materialize(task, Path(dest), "buggy", with_tests=False)
    for rel in hidden_test_files(task):
        (dest / rel).unlink(missing_ok=True)
    _git(["init", "-q"], dest)
    _git(["add", "-A"], dest)
    _git(["commit", "-q", "--no-verify", "-m", "snapshot"], dest)
    return dest


def workspace_diff(workspace: Path) -> str:
    """Everything the agent changed in its working copy (new files included), as a binary-safe git diff."""
    _git(["add", "-A"], workspace)
    return _git(["diff", "--cached", "--binary", "HEAD"], workspace).stdout


# ------------------------------------------------------------------ diff filtering
_DIFF_HEADER = re.compile(r"^diff --git (\S+) (\S+)$")


def _section_paths(section: list[str]) -> tuple[list[str], bool]:
    """The paths a diff section names (a/ b/ prefixes removed), and whether it makes a symlink."""
    paths, symlink = [], False
    m = _DIFF_HEADER.match(section[0])
    # quoted names (odd characters), names with spaces: checked whole (a quote makes them unparseable)
    paths += [m.group(1), m.group(2)] if m else [section[0][len("diff --git "):]]
    for line in section[1:]:
        if line.startswith(("@@", "GIT binary patch")):
            break
        for key in ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to "):
            if line.startswith(key):
                paths.append(line[len(key):].split("\t")[0])
        if line.startswith(("new file mode 120000", "new mode 120000", "old mode 120000", "deleted file mode 120000")):
            symlink = True
    clean = []
    for p in paths:
        if p == "/dev/null":
            continue
        clean.append(p[2:] if p.startswith(("a/", "b/")) else p)
    return clean, symlink


def protected_reason(path: str, task: dict | None = None) -> str | None:
    """Why the grader discards a change to ``path`` (relative to the repository root), or None."""
    if path.startswith('"') or "\\" in path:
        return "unparseable_path"
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        return "outside_repo"
    if p.parts[0] == ".git":
        return "git_internals"
    name = p.name
    if task is not None and path in {test_file(t) for t in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]}:
        return "test_file"
    if any(part in TEST_DIRS for part in p.parts[:-1]) or name.startswith("test_") or name.endswith("_test.py"):
        return "test_file"
    if name in PROTECTED_NAMES or name.endswith(".pth"):
        return "test_config"
    return None


def filter_diff(diff: str, task: dict | None = None) -> tuple[str, list[tuple[str, str]]]:
    """Split ``diff`` per file; keep the sections that touch only unprotected repository paths.

    Returns the kept diff and ``[(path, reason)]`` of what was dropped.
    """
    sections: list[list[str]] = []  # raw lines of each file's section, the "diff --git" line first
    for line in diff.splitlines(keepends=True):
        if line.startswith("diff --git ") or not sections:
            sections.append([line])
        else:
            sections[-1].append(line)
    kept, dropped = [], []
    for raw in sections:
        lines = [ln.rstrip("\n") for ln in raw]
        if not lines[0].startswith("diff --git "):  # text that is not a git diff section: never applied
            if any(ln.strip() for ln in lines):
                dropped.append(("<unparseable>", "unparseable_diff"))
            continue
        paths, symlink = _section_paths(lines)
        bad = [(p, r) for p in paths if (r := protected_reason(p, task))]
        if symlink:
            bad.append((paths[-1] if paths else "?", "symlink"))
        if bad:
            dropped.append(bad[0])
        else:
            kept.append("".join(raw))
    return "".join(kept), dropped


# ------------------------------------------------------------------ running tests
@dataclass
class TestRun:
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> passed / failed / skipped / error
    returncode: int | None = None
    timed_out: bool = False
    output: str = ""
    failures: dict[str, str] = field(default_factory=dict)

    def passed(self, node_id: str) -> bool:
        return self.outcomes.get(node_id) == "passed"


def test_env(home: Path) -> dict[str, str]:
    """The environment of a test run: nothing of the rollout (no key, no reward URL, no task)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def run_tests(repo: Path, node_ids: list[str] | None = None, timeout_s: float = 120.0,
              use_sandbox: bool = True) -> TestRun:
    """Run pytest in ``repo`` on ``node_ids`` (None: the whole suite) and read each test's outcome."""
    repo = Path(repo).resolve()
    with tempfile.TemporaryDirectory(prefix="agl-swe-grade-") as tmp:
        tmp = Path(tmp)
        (tmp / "agl_swe_report.py").write_text(PLUGIN)
        report = tmp / "report.json"
        env = test_env(tmp) | {"PYTHONPATH": str(tmp), "AGL_SWE_REPORT": str(report)}
        argv = [sys.executable, "-s", "-m", "pytest", "-p", "agl_swe_report", "-p", "no:cacheprovider", "-q",
                "--tb=short", "-rN", "-o", "console_output_style=classic", *(node_ids or [])]
        command = " ".join(map(__import__("shlex").quote, argv))
        if use_sandbox and sandbox.sandbox_available():
            full = [*sandbox.sandbox_prefix(hide=[], keep=str(repo), readonly=[]), command]
        else:
            full = ["/bin/sh", "-c", command]
        proc = subprocess.Popen(full, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        run = TestRun()
        try:
            run.output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            run.output, _ = proc.communicate()
            run.timed_out = True
        run.returncode = proc.returncode
        if report.exists():
            try:
                run.outcomes = json.loads(report.read_text())
            except ValueError:
                run.outcomes = {}
        run.failures = _failure_messages(run.output)
    return run


def _failure_messages(output: str) -> dict[str, str]:
    """``E ...`` lines of each failed test in pytest's short tracebacks, keyed by the section title."""
    out: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        m = re.match(r"^_{3,} (.+?) _{3,}$", line)
        if m:
            current = m.group(1)
            out[current] = []
        elif current and line.startswith("E "):
            out[current].append(line[2:].strip())
    return {k: "\n".join(v) for k, v in out.items() if v}


# ------------------------------------------------------------------ grading and cleaning
def evaluate(task: dict, diff: str, timeout_s: float = 120.0, use_sandbox: bool = True) -> dict:
    """Reward of an agent's diff: 1.0 if every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0.0.

    Graded in a fresh copy of the buggy repository with all original tests; protected and outside-the-repo
    entries of the diff are dropped first (listed in ``dropped``).
    """
    kept, dropped = filter_diff(diff or "", task)
    result = {"instance_id": task["instance_id"], "reward": 0.0, "dropped": dropped, "applied": False,
              "error": None, "FAIL_TO_PASS": {}, "PASS_TO_PASS": {}}
    with tempfile.TemporaryDirectory(prefix="agl-swe-eval-") as tmp:
        repo = materialize(task, Path(tmp) / "repo", "buggy", with_tests=True)
        try:
            apply_patch(repo, kept)
            result["applied"] = True
        except PatchError as exc:
            result["error"] = f"patch_failed: {exc}"[:500]
            return result
        shutil.rmtree(repo / ".git", ignore_errors=True)
        tests = list(task["FAIL_TO_PASS"]) + list(task["PASS_TO_PASS"])
        run = run_tests(repo, tests, timeout_s, use_sandbox)
    if run.timed_out:
        result["error"] = "tests_timed_out"
    result["FAIL_TO_PASS"] = {t: run.outcomes.get(t, "missing") for t in task["FAIL_TO_PASS"]}
    result["PASS_TO_PASS"] = {t: run.outcomes.get(t, "missing") for t in task["PASS_TO_PASS"]}
    ok = (not run.timed_out and all(v == "passed" for v in result["FAIL_TO_PASS"].values())
          and all(v == "passed" for v in result["PASS_TO_PASS"].values()))
    result["reward"] = 1.0 if ok else 0.0
    return result


def validate_task(task: dict, timeout_s: float = 120.0) -> tuple[bool, str]:
    """Does the task carry signal? FAIL_TO_PASS must pass on the gold code and fail on the buggy code, and
    PASS_TO_PASS must pass on both. Returns (ok, reason)."""
    if not task.get("FAIL_TO_PASS"):
        return False, "no_fail_to_pass"
    tests = list(task["FAIL_TO_PASS"]) + list(task["PASS_TO_PASS"])
    with tempfile.TemporaryDirectory(prefix="agl-swe-validate-") as tmp:
        try:
            gold = materialize(task, Path(tmp) / "gold", "gold")
            buggy = materialize(task, Path(tmp) / "buggy", "buggy")
        except (PatchError, OSError, subprocess.CalledProcessError) as exc:
            return False, f"setup_failed: {exc}"[:300]
        on_gold = run_tests(gold, tests, timeout_s)
        on_buggy = run_tests(buggy, tests, timeout_s)
    if not all(on_gold.passed(t) for t in task["FAIL_TO_PASS"]):
        return False, "fail_to_pass_fails_before_bug"
    if any(on_buggy.passed(t) for t in task["FAIL_TO_PASS"]):
        return False, "fail_to_pass_passes_with_bug"
    if not all(on_gold.passed(t) and on_buggy.passed(t) for t in task["PASS_TO_PASS"]):
        return False, "pass_to_pass_fails"
    return True, "ok"


def clean_tasks(tasks: list[dict], timeout_s: float = 120.0) -> tuple[list[dict], list[tuple[str, str]]]:
    """Keep the tasks that ``validate_task`` accepts; returns (kept, [(instance_id, reason)] dropped)."""
    kept, dropped = [], []
    for task in tasks:
        ok, reason = validate_task(task, timeout_s)
        (kept.append(task) if ok else dropped.append((task["instance_id"], reason)))
    return kept, dropped
