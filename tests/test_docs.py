"""Every `agl-*` command line in the README and the docs names a real command and real options.

Commands that need running services are checked against their own ``--help`` (the command path must
exist and every ``--option`` on the line must be one it accepts); the README's two commands are run
for real by CI itself (.ci/run runs scripts/test.sh).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
MODULES = {"agl-gateway": "agl_gateway", "agl-controller": "agl_controller", "agl-trainer": "agl_trainer"}


def command_lines() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        in_fence = False
        joined = doc.read_text().replace("\\\n", " ")  # shell line continuations
        for line in joined.splitlines():
            if line.strip().startswith("```"):
                in_fence = not in_fence
                continue
            text = line.strip()
            m = re.match(r"^(?:\.venv/bin/)?(agl-(?:gateway|controller|trainer))\b(.*)$", text)
            if in_fence and m:
                out.append((doc.name, text))
    return out


@cache
def help_text(words: tuple[str, ...]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", MODULES[words[0]], *words[1:], "--help"], capture_output=True,
                          text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    return proc.returncode, proc.stdout + proc.stderr


LINES = command_lines()


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
