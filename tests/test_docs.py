"""Every shell command in the docs is run here, or says why it is not.

Each fenced block of README.md, docs/, bench/ and examples/ that holds a shell command has an HTML comment
(invisible once rendered) on the line before its fence:

- ``<!-- test: run -->``: run as written, in a fresh directory (below);
- ``<!-- test: run with a gateway -->``: the same, with a gateway already serving (``agl-trainer gateway ...``);
- ``<!-- test: run with a recorded run -->``: after a gateway recorded one call and a reward for each of two
  rollouts of a run named like the demo's; ``<run-id>`` and ``<rollout-id>`` are filled in;
- ``<!-- test: run continued -->``: in the same shell as the file's previous run block (its exports, its gateway);
- ``<!-- test: file NAME -->``: a file the commands use: written as NAME where the file's blocks run;
- ``<!-- test: skip: REASON -->``: not run here (Docker, Helm, a cluster, a GPU, minutes of work), and why.

A block without one that has an ``agl-*`` or ``curl`` line, or is marked ``bash``/``sh``, fails the test.

The blocks of one run are one bash script (``set -euo pipefail``) in a temporary directory that holds
``.venv`` (this interpreter's environment), links to the repository's folders, the doc's ``file`` blocks
and ``my_agent.py`` (the reader's agent: one chat call with the OpenAI client). Only environment-specific
values change: the engine at 127.0.0.1:8000 becomes a fake vLLM (tests/fakes.py; a stand-in the doc starts
itself with ``tests/fakes.py --port 8000`` gets a free port), port 8080 a free port,
Redis and the key prefix the test's (``AGL_REDIS_URL``, ``AGL_PREFIX``). An ``agl-gateway serve`` line is
started in the background and waited for (``/healthz``). Every command must exit 0, and the known ones must
print what they promise (``check`` below). Every ``agl-*`` line, run or not, must name a real command with
options it accepts (``--help``). The README's two commands are run by CI itself (.ci/run runs scripts/test.sh).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from fakes import Served, fake_upstream, free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("bench/*.md")),
        *sorted(ROOT.glob("examples/*.md")), *sorted(ROOT.glob("examples/*/*.md"))]
MODULES = {"agl-gateway": "agl_gateway", "agl-controller": "agl_controller", "agl-trainer": "agl_trainer"}
MARK = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
MARKS = re.compile(r"run|run with a gateway|run with a recorded run|run continued|file [\w.-]+|skip: \S.*")
COMMAND = re.compile(r"^(?:\.venv/bin/)?(agl-(?:gateway|controller|trainer)|curl)\b")
SERVER = re.compile(r"^(?:\.venv/bin/)?agl-gateway serve\b")
MY_AGENT = """\
from openai import OpenAI  # reads OPENAI_BASE_URL and OPENAI_API_KEY

answer = OpenAI().chat.completions.create(model="any", messages=[{"role": "user", "content": "What is 3 + 4?"}])
print(answer.choices[0].message.content)
"""


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence
    lang: str
    text: str
    mark: str | None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """Logical lines: continuations joined, blank and comment lines dropped."""
        lines = self.text.replace("\\\n", " ").splitlines()
        return [s for s in (x.strip() for x in lines) if s and not s.startswith("#")]

    def is_shell(self) -> bool:
        return self.lang in ("bash", "sh", "shell", "console") or any(COMMAND.match(c) for c in self.commands())


@cache
def blocks(doc: Path) -> list[Block]:
    out, lines, i = [], doc.read_text().splitlines(), 0
    while i < len(lines):
        if m := re.match(r"^```(\S*)\s*$", lines[i]):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
            mark = MARK.match(before)
            out.append(Block(doc, i + 1, m[1], "\n".join(lines[i + 1:j]) + "\n", mark[1] if mark else None))
            i = j
        i += 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]


def sessions() -> list[list[Block]]:
    """Run blocks grouped into the scripts they form (a ``run continued`` block joins the one before)."""
    out: list[list[Block]] = []
    for b in ALL:
        if b.mark == "run continued" and out and out[-1][0].doc == b.doc:
            out[-1].append(b)
        elif b.mark and b.mark.split()[0] == "run":
            out.append([b])
    return out


SESSIONS = sessions()


# ------------------------------------------------------------------------------------------ every block marked
def test_every_command_block_says_whether_it_runs():
    unmarked = [b.where for b in ALL if b.is_shell() and b.mark is None]
    assert not unmarked, ("add `<!-- test: run -->` (see tests/test_docs.py) or `<!-- test: skip: why -->` on the "
                          f"line before: {unmarked}")
    bad = [(b.where, b.mark) for b in ALL if b.mark is not None and not MARKS.fullmatch(b.mark)]
    assert not bad, f"unknown test marks: {bad}"
    for doc in DOCS:  # a mark with no fence under it would silently mark nothing
        n = sum(bool(MARK.match(x.strip())) for x in doc.read_text().splitlines())
        assert n == sum(b.mark is not None for b in blocks(doc)), f"{doc.name}: a test mark not right above a fence"
    assert len(SESSIONS) >= 8 and sum(b.mark.startswith("skip") for b in ALL if b.mark) >= 10


# ------------------------------------------------------------------------------------------ every command exists
LINES = [(b.doc.name, c) for b in ALL for c in b.commands() if re.match(r"^(?:\.venv/bin/)?agl-", c)]


@cache
def help_text(words: tuple[str, ...]) -> tuple[int, str]:
    from typer.testing import CliRunner

    app = importlib.import_module(MODULES[words[0]] + ".cli").app
    res = CliRunner().invoke(app, [*words[1:], "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    return res.exit_code, res.output


def test_the_docs_have_commands():
    assert len(LINES) >= 10


@pytest.mark.parametrize("doc,line", LINES, ids=[f"{d}:{line[:50]}" for d, line in LINES])
def test_command_exists_with_its_options(doc, line):
    words = shlex.split(line.split("|")[0].split(">")[0].replace(".venv/bin/", ""), comments=True)
    path = [words[0]]
    for w in words[1:]:
        if w.startswith("-") or "/" in w or "<" in w or "." in w or w.isupper():
            break
        code, _ = help_text((*path, w))
        if code != 0:
            break
        path.append(w)
    code, text = help_text(tuple(path))
    assert code == 0, f"{doc}: `{' '.join(path)} --help` failed:\n{text}"
    for opt in [w.split("=")[0] for w in words if w.startswith("--")]:
        assert opt in text, f"{doc}: `{line}` uses {opt}, which `{' '.join(path)}` does not accept"


# ------------------------------------------------------------------------------------------ the run blocks, run
def workdir(tmp_path: Path, doc: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(sys.prefix)
    for p in ROOT.iterdir():
        if not p.name.startswith(".") and p.name != "runs":
            (work / p.name).symlink_to(p)
    for b in blocks(doc):
        if b.mark and b.mark.startswith("file "):
            (work / b.mark.split()[1]).write_text(b.text)
    (work / "my_agent.py").write_text(MY_AGENT)
    return work


def script(lines: list[str], port: int) -> str:
    out = ["set -euo pipefail",
           'wait_http() { for _ in $(seq 300); do curl -sf -o /dev/null "$1" && return 0; kill -0 $! || break; sleep 0.1; done; '
           'echo "no answer from $1"; cat gateway-*.log; return 1; }']
    for n, cmd in enumerate(lines):
        out.append(f"printf '\\n@@@ {n} %s\\n' \"$(date +%s.%N)\"")
        if SERVER.match(cmd):  # runs until stopped: in the background, once it answers go on
            cmd = re.sub(r"\s+#.*$", "", cmd)
            p = re.search(r"--port[ =](\d+)", cmd)
            out += [f"{cmd} > gateway-{n}.log 2>&1 &", f"wait_http http://127.0.0.1:{p[1] if p else port}/healthz"]
        else:
            out.append(cmd)
    return "\n".join(out) + "\n"


def stop_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def check(cmd: str, out: str, work: Path, ctx: dict) -> None:
    """What a known command must have printed (or written, with ``> FILE``)."""
    c = re.sub(r"\s+#[^'\"]*$", "", cmd.replace(".venv/bin/", ""))
    if redirect := re.search(r"\s>\s*(\S+)$", c):
        out = (work / redirect[1]).read_text()
    if m := re.match(r"agl-trainer rollouts show (\S+)", c):
        shown = json.loads(out) if "--json" in c else None
        if shown is not None:
            assert shown["rollout_id"] == m[1] and shown["calls"], out
        else:
            assert m[1] in out and re.search(r"^call \S+ ", out, re.M), out
        if ctx["rewarded"]:
            assert shown["reward"] is not None if shown else re.search(r"'reward': -?\d", out), out
    elif m := re.match(r"agl-trainer rollouts export\b", c):
        shape = (re.search(r"--shape (\S+)", c) or [None, "calls"])[1]
        if (o := re.search(r"--out (\S+)", c)) and "--format parquet" in c:
            from datasets import load_dataset

            records = load_dataset("parquet", data_files=str(work / o[1]), split="train",
                                   cache_dir=str(work / "hf-cache")).to_list()
        else:
            text = (work / o[1]).read_text() if o else out
            records = [json.loads(x) for x in text.splitlines() if x.strip()]
        field = {"calls": "response_token_ids", "rows": "response_mask", "messages": "messages"}[shape]
        assert records and all(r[field] for r in records), out
        if r := re.search(r"--min-reward (\S+)", c):
            assert shape == "calls" or all(x["reward"] >= float(r[1]) for x in records)
        if r := re.search(r"--rollout (\S+)", c):
            assert {x["rollout_id"] for x in records} == {r[1]}
        if r := re.search(r"--run (\S+)", c):
            assert all(x["rollout_id"].startswith(r[1]) for x in records)
    elif m := re.match(r"agl-trainer rollouts list\b", c):
        r = re.search(r"--run (\S+)", c)
        assert (r[1] if r else "│") in out, out
    elif re.match(r"agl-trainer rollouts create\b", c):
        ctx["created"] = out.split()
        n = re.search(r"--n (\d+)", c)
        assert len(ctx["created"]) == (int(n[1]) if n else 1), out
    elif re.match(r"agl-trainer gateway status\b", c):
        assert re.search(r"│ \S+ +│ (True|False) +│", out), out
    elif re.match(r"agl-trainer gateway pause\b", c):
        assert re.search(r"paused and drained: [1-9]\d* replica", out), out
    elif re.match(r"agl-trainer gateway resume\b", c):
        assert "resumed" in out
    elif re.match(r"agl-controller run .*--dry-run", c):
        from agl_controller.k8s import validate_job

        jobs = [d for d in yaml.safe_load_all(out) if d]
        assert len(jobs) == (c.count("--input") or len(ctx.get("created", []))) > 0, out
        for job in jobs:
            validate_job(job)
    elif c.startswith("curl "):
        assert out.strip(), "curl printed nothing"
        if out.lstrip().startswith("{"):
            json.loads(out)


def recorded_run(port: int) -> tuple[list[str], dict]:
    """Two rollouts named like a demo run's (``{run}-q{n}-g{k}-{i}``), their group registered with the run, each
    with one call and a reward."""
    run = time.strftime("%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]  # agl_trainer.run.new_run_id's format
    gw = f"http://127.0.0.1:{port}/rollouts/{run}-q0-g0-%d/attempts/0"
    post = "curl -sf -o /dev/null -H 'Content-Type: application/json' "
    # the group registered as the trainer's scheduler registers it: `--run` selects a run's registered groups
    register = ("python -c 'import asyncio, os; from agl_common.schemas import GroupInfo; "
                "from agl_common.store import Store; s = Store(os.environ[\"AGL_REDIS_URL\"], "
                "os.environ[\"AGL_PREFIX\"]); asyncio.run(s.register_group(GroupInfo(group_id=\"%s-q0-g0\", "
                "rollout_ids=[\"%s-q0-g0-0\", \"%s-q0-g0-1\"], owner=\"%s\", run=\"%s\")))'" % ((run,) * 5))
    lines = [register, f"agl-gateway serve --open --port {port}"]
    for i in range(2):
        lines += [post + f"""-d '{{"model": "m", "messages": [{{"role": "user", "content": "2+2"}}]}}' """
                  + gw % i + "/v1/chat/completions", post + f"""-d '{{"value": 1}}' """ + gw % i + "/reward"]
    return lines, {"<run-id>": run, "<rollout-id>": f"{run}-q0-g0-0"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("session", SESSIONS, ids=[s[0].where for s in SESSIONS])
def test_doc_commands_run(session, tmp_path, redis_url, prefix):
    first = session[0]
    assert first.mark != "run continued", f"{first.where}: `run continued` with no run block before it"
    port = free_port()
    with Served(fake_upstream()) as engine:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OPENAI_", "ANTHROPIC_"))}
        env.update(PATH=f"{Path(sys.prefix) / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", AGL_REDIS_URL=redis_url,
                   AGL_PREFIX=prefix, AGL_PORT=str(port), AGL_UPSTREAM=engine.url + "/v1", NO_PROXY="127.0.0.1",
                   no_proxy="127.0.0.1")
        values = {"http://127.0.0.1:8000": engine.url, "127.0.0.1:8080": f"127.0.0.1:{port}",
                  "--port 8080": f"--port {port}", "fakes.py --port 8000": f"fakes.py --port {free_port()}"}
        setup: list[str] = []
        if first.mark == "run with a gateway":
            setup = [f"agl-gateway serve --port {port}"]
        elif first.mark == "run with a recorded run":
            setup, placeholders = recorded_run(port)
            values.update(placeholders)
        lines = []
        for b in session:
            text = b.text
            for old, new in values.items():
                text = text.replace(old, new)
            lines += Block(b.doc, b.line, b.lang, text, b.mark).commands()
        work = workdir(tmp_path, first.doc)
        log = tmp_path / "out.txt"
        with log.open("wb") as f:
            proc = subprocess.Popen(["bash", "-c", script(setup + lines, port)], cwd=work, env=env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                stop_group(proc.pid)
    parts = re.split(r"^@@@ (\d+) \S+\n", log.read_text(errors="replace"), flags=re.M)
    outputs = {int(n): text for n, text in zip(parts[1::2], parts[2::2])}
    last = max(outputs, default=0)
    where = ", ".join(b.where for b in session)
    assert rc == 0, (f"{where}: `{(setup + lines)[last]}` failed ({rc}):\n{outputs.get(last, log.read_text())[-6000:]}"
                     + "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in work.glob("gateway-*.log")))
    assert len(outputs) == len(setup + lines), f"{where}: not every command ran:\n{log.read_text()[-6000:]}"
    ctx = {"rewarded": "/reward" in "".join(setup + lines)}
    for n, cmd in enumerate(lines, start=len(setup)):
        try:
            check(cmd, outputs[n], work, ctx)
        except AssertionError as exc:
            raise AssertionError(f"{where}: `{cmd}` did not print what it should: {exc}") from None
