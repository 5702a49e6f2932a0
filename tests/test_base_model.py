"""The base model is a config field (issue 26): a local model directory, else $AGL_BASE_MODEL_DIR, else the
shipped GGUF converted once."""

from __future__ import annotations

import pytest
from agl_trainer.config import TrainConfig
from agl_trainer.model import ensure_base_model
from pydantic import ValidationError


def test_base_model_field_names_a_model_directory(tmp_path, monkeypatch):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = TrainConfig(base_model=str(model))
    monkeypatch.setenv("AGL_BASE_MODEL_DIR", str(tmp_path / "elsewhere"))
    assert ensure_base_model(cfg.base_model) == model  # the config wins over the variable
    assert ensure_base_model(None) == tmp_path / "elsewhere"
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(f"base_model: {model}\n")
    assert TrainConfig.from_yaml(cfg_file).base_model == str(model)


def test_base_model_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="not a model directory"):
        TrainConfig(base_model=str(tmp_path))
    with pytest.raises(ValidationError, match="not a model directory"):
        TrainConfig(base_model=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ensure_base_model(tmp_path)
