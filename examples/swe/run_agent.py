"""One rollout of mini-SWE-agent on one coding task, then its grading (the harness command of config.yaml).

1. reads the task from ``AGL_INPUT`` (CONTRACT §2; a task of make_tasks.py);
2. prepares the agent's working copy under ``--work-root``: the buggy code as a fresh one-commit ``git init``
   snapshot, without the files of the hidden FAIL_TO_PASS tests;
3. runs mini-SWE-agent, unchanged, through its own command line (``python -m minisweagent.run.mini``) with
   mini_swe.yaml: model ``openai/$AGL_MODEL``, so LiteLLM calls the gateway at ``OPENAI_BASE_URL`` with the
   rollout key ``OPENAI_API_KEY``; the ``default`` (non-interactive) agent; bounded steps and time; each shell
   command in the sandbox of sandbox.py (no network, no other processes, task data hidden);
4. after the agent exits: ``git add -A && git diff --binary`` of the working copy, graded by
   ``grading.evaluate`` in a fresh copy with the original tests (reward 1.0 if FAIL_TO_PASS now pass and
   PASS_TO_PASS still pass, else 0.0);
5. posts ``{"value": reward, "message": ...}`` to ``AGL_REWARD_URL`` with ``Authorization: Bearer
   $OPENAI_API_KEY``, prints one JSON line (instance, exit status, reward, per-test outcomes, dropped diff
   entries) and, with ``--output-dir`` / ``AGL_OUTPUT_DIR``, saves ``{rollout}.{attempt}.diff``, ``.traj.json``
   and ``.result.json`` there.

If mini-SWE-agent stopped on an infrastructure error (the gateway or engine unreachable or failing), no reward
is posted and the script exits 75, so the controller records a failure (``exit_code:75``) rather than a 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grading

#: mini-SWE-agent exit statuses (exception names) that are failures of the infrastructure, not of the agent
INFRA_EXIT_STATUSES = {"APIConnectionError", "InternalServerError", "ServiceUnavailableError", "Timeout",
                       "APIError", "RateLimitError", "BadGatewayError", "APIResponseValidationError"}
EXIT_INFRA = 75


def env_default(name: str, default):
    value = os.environ.get(name)
    return type(default)(value) if value not in (None, "") else default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=env_default("AGL_SWE_CONFIG", str(HERE / "mini_swe.yaml")),
                   help="mini-SWE-agent config file")
    p.add_argument("--step-limit", type=int, default=env_default("AGL_SWE_STEP_LIMIT", 30))
    p.add_argument("--agent-timeout", type=float, default=env_default("AGL_SWE_AGENT_TIMEOUT_S", 900.0),
                   help="seconds; mini-SWE-agent's wall-time limit, and its process is killed a bit later")
    p.add_argument("--max-tokens", type=int, default=env_default("AGL_SWE_MAX_TOKENS", 1024))
    p.add_argument("--test-timeout", type=float, default=env_default("AGL_SWE_TEST_TIMEOUT_S", 120.0))
    p.add_argument("--work-root", default=env_default("AGL_SWE_WORK_ROOT",
                                                      str(Path(tempfile.gettempdir()) / "agl-swe")))
    p.add_argument("--output-dir", default=env_default("AGL_OUTPUT_DIR", ""))
    p.add_argument("--hide", action="append", default=[p for p in os.environ.get("AGL_SWE_HIDE", "").split(":") if p],
                   help="another path hidden from the agent's commands (repeatable; AGL_SWE_HIDE=a:b)")
    p.add_argument("--keep-workdir", action="store_true")
    return p.parse_args(argv)


def hidden_paths(task: dict, work_root: Path, extra: list[str]) -> list[str]:
    """What the agent's commands must not see: the task data, the clean repositories, every rollout's work
    folder (its own is mounted back), the run logs, and ``extra``."""
    paths = [HERE / "repos", HERE / "data", grading.resolve_repo(task["repo"]), work_root, Path.cwd() / "runs",
             *map(Path, extra)]
    out: list[str] = []
    for p in paths:
        p = p.resolve()
        if p.is_file():
            p = p.parent
        if p.exists() and str(p) not in out and p != Path("/"):
            out.append(str(p))
    return out


def mini_env(run_dir: Path) -> dict[str, str]:
    """mini-SWE-agent's process environment: ours without the task and the reward URL, plus its settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("AGL_INPUT", "AGL_REWARD_URL")}
    env.update({"MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_GLOBAL_CONFIG_DIR": str(run_dir / "mswea"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "PYTHONPATH": str(HERE), "PYTHONUNBUFFERED": "1"})
    return env


def run_mini(task: dict, workspace: Path, run_dir: Path, args: argparse.Namespace, hide: list[str]) -> dict:
    traj = run_dir / "traj.json"
    model = os.environ.get("AGL_MODEL", "smollm2")
    argv = [sys.executable, "-m", "minisweagent.run.mini", "--agent-class", "default",
            "-m", f"openai/{model}", "-t", task["problem_statement"], "-o", str(traj),
            "-c", args.config,
            "-c", f"environment.cwd={workspace}",
            "-c", f"environment.hide_paths={json.dumps(hide)}",
            "-c", f"agent.step_limit={args.step_limit}",
            "-c", f"agent.wall_time_limit_seconds={int(args.agent_timeout)}",
            "-c", f"model.model_kwargs.max_tokens={args.max_tokens}"]
    started = time.time()
    proc = subprocess.Popen(argv, cwd=workspace, env=mini_env(run_dir), start_new_session=True)
    killed = False
    try:
        proc.wait(timeout=args.agent_timeout + 120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
    info: dict = {"returncode": proc.returncode, "killed": killed, "agent_s": round(time.time() - started, 1)}
    if traj.exists():
        data = json.loads(traj.read_text())
        info["exit_status"] = data.get("info", {}).get("exit_status", "")
        info["api_calls"] = data.get("info", {}).get("model_stats", {}).get("api_calls")
        info["trajectory"] = traj
    else:
        info["exit_status"] = "NoTrajectory"
    return info


def post_reward(value: float, message: str) -> None:
    url = os.environ.get("AGL_REWARD_URL")
    if not url:
        return
    resp = httpx.post(url, json={"value": value, "message": message[:2000]},
                      headers={"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"}, timeout=30)
    resp.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = json.loads(os.environ["AGL_INPUT"])
    work_root = Path(args.work_root)
    work_root.mkdir(parents=True, exist_ok=True)
    rollout = f"{os.environ.get('AGL_ROLLOUT_ID', 'local')}.{os.environ.get('AGL_ATTEMPT_ID', '0')}"
    run_dir = Path(tempfile.mkdtemp(prefix=f"{rollout}-", dir=work_root))
    try:
        workspace = grading.prepare_workspace(task, run_dir / "repo")
        hide = hidden_paths(task, work_root, args.hide)
        info = run_mini(task, workspace, run_dir, args, hide)
        if info["exit_status"] in INFRA_EXIT_STATUSES:
            print(json.dumps({"instance_id": task["instance_id"], "infra_error": info["exit_status"]}))
            return EXIT_INFRA
        diff = grading.workspace_diff(workspace)
        result = grading.evaluate(task, diff, timeout_s=args.test_timeout)
        summary = {"instance_id": task["instance_id"], "exit_status": info["exit_status"],
                   "api_calls": info.get("api_calls"), "agent_s": info["agent_s"], "killed": info["killed"],
                   "diff_bytes": len(diff), "reward": result["reward"], "dropped": result["dropped"],
                   "error": result["error"], "FAIL_TO_PASS": result["FAIL_TO_PASS"],
                   "sandbox": grading.sandbox.sandbox_available()}
        if args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{rollout}.diff").write_text(diff)
            (out / f"{rollout}.result.json").write_text(json.dumps(summary | {"PASS_TO_PASS": result["PASS_TO_PASS"]},
                                                                   indent=1))
            if info.get("trajectory"):
                shutil.copy(info["trajectory"], out / f"{rollout}.traj.json")
        print("AGENT DIFF:\n" + diff[:4000])
        print(json.dumps(summary))
        post_reward(result["reward"], json.dumps({k: summary[k] for k in ("exit_status", "diff_bytes", "dropped")}))
        return 0
    finally:
        if not args.keep_workdir:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
