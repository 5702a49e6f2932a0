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
