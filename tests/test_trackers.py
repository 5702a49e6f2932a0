"""Experiment trackers (issue 17): each chosen tracker gets the config, every step's metrics and the evaluations
through its own library, and each is read back with its own reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agl_trainer import trackers as trackers_mod
from agl_trainer.config import TrainConfig
from agl_trainer.trackers import Trackers, TrackerMissing, check_trackers, flatten

pytestmark = pytest.mark.integrations

STEP = {"step": 1, "policy_version": 1, "reward_mean": 0.25, "accuracy": 0.125, "rows": 32, "merge_breaks": 2,
        "failed": 0, "loss": -0.01, "step_s": 12.5, "groups": ["r-g0", "r-g1"], "group_ages": [0, 0],
        "merge_break_classes": {"other": 2}, "merge_break_examples": {"other": [{"rollout_id": "x", "position": 3}]},
        "skipped_update": None, "dropped_rows": {}}


def wandb_records(run_dir: Path):
    """Records of a W&B run's transaction log (``run-*.wandb``), decoded with W&B's own protobuf classes.

    The file is a 7-byte W&B header followed by LevelDB-log framing (32 KiB blocks, each record chunk with a
    7-byte header: crc32c, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4); wandb 0.31 no longer ships a
    Python reader for it (its reader lives in the Go ``wandb-core``).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0 and length == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(chunks))
            chunks = []
            yield rec


def test_flatten_keeps_numbers_only():
    flat = flatten(STEP, "train/")
    assert flat["train/reward_mean"] == 0.25 and flat["train/merge_break_classes/other"] == 2.0
    assert not any(k.startswith(("train/groups", "train/merge_break_examples", "train/skipped")) for k in flat)


def test_every_tracker_reads_back(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    run_dir = tmp_path / "runs" / "demo" / "1201-000000-abcd"
    run_dir.mkdir(parents=True)
    cfg = TrainConfig(steps=2, lr=3e-4).model_dump(mode="json")
    step2 = {**STEP, "step": 2, "reward_mean": 0.5, "loss": 0.02}
    # "console" is accepted and builds no tracker: the run prints its own lines (tests/test_loop.py reads them)
    with Trackers(list(trackers_mod.TRACKERS), run_dir) as t:
        assert len(t.trackers) == len(trackers_mod.TRACKERS) - 1
        t.log_config(cfg)
        t.log_eval("before", {"accuracy": 0.05, "n": 40, "failed": 1}, 0)
        t.log_metrics(STEP, 1)
        t.log_metrics(step2, 2)
        t.log_eval("after", {"accuracy": 0.1, "n": 40, "failed": 0}, 2)

    # jsonl: the lines metrics.jsonl always had
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"eval": "before", "accuracy": 0.05, "n": 40, "failed": 1}, STEP, step2,
                     {"eval": "after", "accuracy": 0.1, "n": 40, "failed": 0}]
    # tensorboard: TensorBoard's own event reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert [(e.step, round(e.value, 4)) for e in ea.Scalars("train/reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, round(e.value, 4)) for e in ea.Scalars("eval/accuracy")] == [(0, 0.05), (2, 0.1)]
    assert "train/merge_break_classes/other" in ea.Tags()["scalars"]
    (config_text,) = ea.Tensors("config/text_summary")
    assert '"lr": 0.0003' in config_text.tensor_proto.string_val[0].decode()

    # wandb: the offline run directory's transaction log
    history, config, summary = [], {}, {}
    for rec in wandb_records(run_dir):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "summary":
            summary.update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json) for u in rec.summary.update})
    rows = {h["_step"]: h for h in history}
    assert rows[1]["train/reward_mean"] == 0.25 and rows[2]["train/reward_mean"] == 0.5
    assert rows[0]["eval/accuracy"] == 0.05 and rows[2]["eval/accuracy"] == 0.1
    assert config["lr"] == 0.0003 and config["steps"] == 2
    assert summary.get("eval_after/accuracy") == 0.1

    # mlflow: a local SQLite store, read with MlflowClient
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    exp = client.get_experiment_by_name("demo")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.0003" and run.data.params["loggers"] == json.dumps(cfg["loggers"])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/reward_mean")] == [
        (1, 0.25), (2, 0.5)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")) == [
        (0, 0.05), (2, 0.1)]


def test_jsonl_is_always_written(tmp_path):
    with Trackers(["tensorboard"], tmp_path) as t:
        assert t.names == ["jsonl", "tensorboard"]
        t.log_metrics(STEP, 1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == STEP


def test_missing_or_unknown_tracker_is_one_clear_line(monkeypatch):
    real = trackers_mod.find_spec
    monkeypatch.setattr(trackers_mod, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(TrackerMissing, match=r"logger 'wandb' needs wandb: pip install wandb==0\.31\.0"):
        check_trackers(["console", "wandb"])
    from agl_trainer.cli import app

    res = CliRunner().invoke(app, ["demo", "--logger", "console,wandb"])
    assert res.exit_code == 2
    assert res.output.strip() == "error: logger 'wandb' needs wandb: pip install wandb==0.31.0"
    res = CliRunner().invoke(app, ["demo", "--logger", "neptune"])
    assert res.exit_code == 2 and "unknown logger 'neptune'; choose from console, jsonl" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_config_file_names_its_loggers(tmp_path):
    (tmp_path / "c.yaml").write_text("loggers: [console, tensorboard]\n")
    assert TrainConfig.from_yaml(tmp_path / "c.yaml").loggers == ["console", "tensorboard"]
    (tmp_path / "bad.yaml").write_text("loggers: [tensorbored]\n")
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="loggers"):
        TrainConfig.from_yaml(tmp_path / "bad.yaml")
