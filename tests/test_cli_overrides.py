"""Command-line overrides reach every backend: ``train --backend verl`` used to hand verl's side the YAML file
as written, so --seed, --redis, --prefix, --logger and AGL_REDIS_URL were silently dropped there."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import yaml


def test_train_backend_verl_gets_the_resolved_config(tmp_path, base_model):
    seen = tmp_path / "seen.yaml"
    fake = tmp_path / "verl-python"  # stands in for .venv-verl's Python: keeps the config it was handed
    fake.write_text(f"#!/bin/sh\ncp \"$3\" {seen}\necho \"$@\" > {tmp_path / 'argv'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"steps": 3, "seed": 1, "out_dir": str(tmp_path / "runs"),
                                      "redis_url": "redis://127.0.0.1:6379/0"}))
    env = {**os.environ, "AGL_VERL_PYTHON": str(fake), "AGL_REDIS_URL": "redis://127.0.0.1:6390/2"}
    res = subprocess.run([sys.executable, "-m", "agl_trainer", "train", str(config), "--backend", "verl", "--seed",
                          "7", "--prefix", "exp7:", "--logger", "tensorboard"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = yaml.safe_load(seen.read_text())
    assert (got["seed"], got["prefix"], got["backend"], got["steps"]) == (7, "exp7:", "verl", 3)
    assert got["redis_url"] == "redis://127.0.0.1:6390/2"  # AGL_REDIS_URL over the file, as on the cpu backend
    assert "tensorboard" in got["loggers"]
    assert Path((tmp_path / "argv").read_text().split()[2]).name == "config.resolved.yaml"


TASK = "def train_problems():\n    return [{'q': 1}]\n\ndef heldout_problems():\n    return [{'q': 2}]\n"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agl_trainer", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_a_bad_task_is_one_line_and_exit_2_before_anything_starts(tmp_path):
    """A misspelt task function, a missing task file, one that fails to import, a misspelt correct_fn (it used to
    fall back to reward >= 1 without a word): exit 2, one line naming it, no traceback, no run directory."""
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    cases = {"train_fn: train_problemz": "has no function 'train_problemz' (its functions: heldout_problems, "
                                         "train_problems)",
             "heldout_fn: held": "has no function 'held'",
             "correct_fn: is_right": "has no function 'is_right'",
             "task_file: missing.py": "task file missing.py not found",
             "task_file: broken.py": "failed to import: ModuleNotFoundError"}
    for line, says in cases.items():
        cfg = tmp_path / "cfg.yaml"
        head = "" if line.startswith("task_file:") else "task_file: task.py\n"  # (a key given twice is refused)
        cfg.write_text(f"{head}out_dir: {tmp_path / 'runs'}\n{line}\n")
        for args in (["train", str(cfg)], ["eval", str(cfg)]) if "train_fn" not in line else (["train", str(cfg)],):
            res = _cli(*args, cwd=tmp_path)
            assert res.returncode == 2, (line, args, res.stdout[-500:], res.stderr[-2000:])
            assert says in res.stderr and "Traceback" not in res.stderr, (line, res.stderr)
    assert not (tmp_path / "runs").exists()
