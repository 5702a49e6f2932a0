"""The task file: a Python file whose functions give the training and held-out inputs (``train_fn``,
``heldout_fn``) and, optionally, the task's notion of a solved input (``correct_fn``, ``is_correct`` by default).
Imported once per use; every fault of the user's file is a :class:`TaskError` that names the file and the fault.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig


class TaskError(ValueError):
    """The task file or one of its functions cannot be used; the message says which and why."""


def _task_module(task_file: str | Path):
    """Import ``task_file``. Raises :class:`TaskError` if it is missing or fails to import."""
    path = Path(task_file)
    if not path.is_file():
        raise TaskError(f"task file {path} not found (run from the repository root?)")
    spec = importlib.util.spec_from_file_location(f"agl_task_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any error of the user's file (a sys.exit() too: it
        # ended the trainer with status 0 and not a word), reported as theirs
        raise TaskError(f"task file {path} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _task_function(module, task_file: str | Path, fn: str) -> Callable:
    f = getattr(module, fn, None)
    if not callable(f):
        known = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise TaskError(f"task file {task_file} has no function {fn!r} (its functions: {', '.join(known) or 'none'})")
    return f


#: Most task inputs a task function may give (each is checked and kept in memory: ~14 s and a few GB at this bound).
MAX_TASKS = 1_000_000


#: (task file, its size and mtime, function) → the inputs the function gave: called once per process, so the check
#: at start and the run see the same inputs (a function that draws at random was checked on another sample).
_GIVEN: dict[tuple, list[dict]] = {}


def load_tasks(task_file: str | Path, fn: str) -> list[dict]:
    """Call ``fn()`` from the Python file ``task_file``; it returns the task inputs (JSON objects: each becomes a
    rollout's input). Called once per process for one file (as it is on disk) and function: later calls return a
    new list of the same inputs.

    Raises :class:`TaskError` if the file is missing or fails to import, has no function ``fn``, if ``fn()``
    raises (or calls ``sys.exit``), gives more than :data:`MAX_TASKS` items (an endless generator would fill
    memory), or if an item is not a dict that JSON can hold.
    """
    from agl_common.schemas import Rollout, long_integer
    from pydantic_core import PydanticSerializationError

    try:
        st = Path(task_file).stat()
        key = (str(Path(task_file).resolve()), st.st_size, st.st_mtime_ns, fn)
    except OSError:  # (missing: _task_module says so)
        key = None
    if key in _GIVEN:
        return list(_GIVEN[key])
    f = _task_function(_task_module(task_file), task_file, fn)
    try:
        tasks = list(itertools.islice(f(), MAX_TASKS + 1))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's function, reported as theirs
        raise TaskError(f"task file {task_file}: {fn}() failed: {type(exc).__name__}: {exc}") from exc
    if len(tasks) > MAX_TASKS:
        raise TaskError(f"task file {task_file}: {fn}() gives more than {MAX_TASKS:,} items (an endless generator?): "
                        "give at most that many")
    for i, task in enumerate(tasks):
        try:
            if not isinstance(task, dict):
                raise TypeError(f"a rollout input is a dict, got {type(task).__name__}")
            # as a rollout stores it (pydantic: a Decimal, a Path, a set become JSON), then as Redis reads it back
            if (big := long_integer(Rollout(rollout_id="check", input=task).model_dump_json())) is not None:
                raise TypeError(f"the integer {big} is beyond 64 bits (it would be stored bent)")
            try:  # pydantic writes NaN and infinity as null: the harness would read null where the task has NaN
                json.dumps(task, allow_nan=False, default=lambda _: None)
            except ValueError:
                raise ValueError("it holds NaN or infinity, which JSON cannot (it would be stored as null)") from None
        except (TypeError, ValueError, PydanticSerializationError) as exc:
            raise TaskError(f"task file {task_file}: {fn}() item {i} is not a JSON object: {exc}") from None
    if key is not None:
        _GIVEN[key] = tasks
    return list(tasks)


def default_is_correct(task: dict, reward: float | None) -> bool:
    """Used when the task file defines no ``is_correct``: a reward of at least 1 counts as solved."""
    return reward is not None and reward >= 1.0


def load_is_correct(task_file: str | Path, fn: str | None = "is_correct") -> Callable[[dict, float | None], bool]:
    """The task's own notion of a solved input, ``fn(task, reward) -> bool`` from ``task_file``: its
    ``is_correct`` by default, or :func:`default_is_correct` if the file has none. Another name that is not
    in the file raises :class:`TaskError` (a misspelt name never falls back silently)."""
    module = _task_module(task_file)
    if (fn or "is_correct") == "is_correct" and not callable(getattr(module, "is_correct", None)):
        return default_is_correct
    user = _task_function(module, task_file, fn)

    def is_correct(task: dict, reward: float | None) -> bool:
        """The task file's function, any error of it a :class:`TaskError` naming it (one line: an error on an input
        but the first checked at start was a traceback after a whole evaluation; round 23)."""
        try:
            answer = user(task, reward)
            if inspect.isawaitable(answer) or inspect.isgenerator(answer) or inspect.isasyncgen(answer):
                getattr(answer, "close", lambda: None)()  # (an async def: a coroutine is true, every answer was
                raise TypeError(f"it returned a {type(answer).__name__}, not a truth value (an async def or a "  # right)
                                "generator?)")
            return bool(answer)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code
            raise TaskError(f"task file {task_file}: {fn}(input, {reward!r}) raised {type(exc).__name__}: "
                            f"{exc}"[:500]) from exc

    return is_correct


def check_task(cfg: TrainConfig, train: bool = True) -> None:
    """Before any service starts: the task file imports and has ``cfg.train_fn`` (if ``train``; an evaluation
    needs none), ``cfg.heldout_fn`` and ``cfg.correct_fn`` (unless that is the default ``is_correct`` and
    absent); the input functions are called and their inputs checked (:func:`load_tasks`: broken data was found
    only once the engine had started), the training inputs (or, for an evaluation, the held-out ones) not
    empty; ``cfg.correct_fn`` is called on one input with the rewards 0 and 1 (its answer must be a truth value).
    Raises :class:`TaskError`."""
    train_inputs = load_tasks(cfg.task_file, cfg.train_fn) if train else []
    if train and not train_inputs:
        raise TaskError(f"task file {cfg.task_file}: {cfg.train_fn}() returned no inputs")
    heldout = load_tasks(cfg.task_file, cfg.heldout_fn)
    if not heldout and not train:
        raise TaskError(f"task file {cfg.task_file}: {cfg.heldout_fn}() returned no inputs (nothing to evaluate)")
    is_correct = load_is_correct(cfg.task_file, cfg.correct_fn)
    from agl_common.schemas import Rollout

    sample = Rollout(rollout_id="check", input=(heldout or train_inputs)[0]).model_dump(mode="json")["input"]
    for reward in (0.0, 1.0):  # on one input: a judge that fails on every input fails here, not after vLLM started
        try:
            is_correct(sample, reward)  # (the input as a rollout holds it)
        except TaskError as exc:  # (load_is_correct's wrapper: the user's own error is its cause)
            cause = exc.__cause__
            raise TaskError(f"task file {cfg.task_file}: {cfg.correct_fn}(input, {reward}) failed on the first "
                            f"input: {type(cause).__name__}: {cause}") from None


def check_controller_imports(cfg: TrainConfig) -> None:
    """Before any service starts: the modules the controller will import, ``cfg.reward_fn``'s and each of
    ``cfg.preload``, can be found by this interpreter from this directory (the controller is started with this
    interpreter, here; with the verl backend it runs in verl's own environment, so this check is not made), and
    ``cfg.command`` starts as the controller would start it (:func:`agl_controller.spawn.check_command`), and
    ``cfg.harness_user`` names users the controller can become, one per concurrent run
    (:func:`agl_controller.spawn.harness_users`).
    Raises :class:`TaskError` naming the field and the module or the command's fault."""
    import importlib.util
    import os
    import sys

    wanted = [("reward_fn", cfg.reward_fn.partition(":")[0])] if cfg.reward_fn else []
    wanted += [("preload", m) for m in cfg.preload]
    sys.path.insert(0, os.getcwd())  # as `python -m agl_controller` sees it
    try:
        for field_name, module in wanted:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a parent package that does not import
                found = False
            if not found:
                raise TaskError(f"{field_name}: no module named {module!r} here (the controller imports it)")
    finally:
        sys.path.remove(os.getcwd())
    # the command as the controller will start it (its `python` is this interpreter): a misspelt program, or one
    # --preload cannot fork (`bash run.sh`, `python -u`), failed only once vLLM had started
    from agl_common.settings import command_argv
    from agl_controller.spawn import LaunchError, check_command, check_user_runs, harness_users

    from .stack import harness_command

    try:
        check_command(command_argv(harness_command(cfg.command, sys.executable)), cfg.preload, found=True)
    except (LaunchError, ValueError) as exc:
        raise TaskError(f"command: {exc}") from None
    if cfg.harness_user is not None:
        try:
            for user in harness_users(cfg.harness_user, cfg.concurrency):
                check_user_runs(user, command_argv(harness_command(cfg.command, sys.executable)), os.getcwd())
        except LaunchError as exc:
            raise TaskError(f"harness_user: {str(exc).removeprefix('run-as: ')}") from None
