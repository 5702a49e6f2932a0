"""``agl-trainer``: train, demo, rollouts, gateway control (CONTRACT §4)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import tempfile
from pathlib import Path

import typer
from agl_common.settings import (DEFAULT_PREFIX, DEFAULT_REDIS_URL, allowed_hosts, check_bind_host, printable,
                                 redacted_url)
from rich.table import Table

from .report import output_console

app = typer.Typer(add_completion=False, help="AGL trainer: harnessed agentic RL.")
rollouts_app = typer.Typer(add_completion=False, help="Create and read rollouts and their recorded calls.")
gateway_app = typer.Typer(add_completion=False, help="Pause, resume and inspect every gateway replica.")
app.add_typer(rollouts_app, name="rollouts")
app.add_typer(gateway_app, name="gateway")

RedisOpt = typer.Option(DEFAULT_REDIS_URL, "--redis", envvar="AGL_REDIS_URL", help="Redis URL")
PrefixOpt = typer.Option(DEFAULT_PREFIX, "--prefix", envvar="AGL_PREFIX", help="Redis key prefix")
# train/demo: unset means "the config's value" (which defaults to the same URL and prefix)
RunRedisOpt = typer.Option(None, "--redis", envvar="AGL_REDIS_URL", help="Redis URL (overrides the config)")
RunPrefixOpt = typer.Option(None, "--prefix", envvar="AGL_PREFIX", help="Redis key prefix (overrides the config)")


def _redis_overrides(redis: str | None, prefix: str | None) -> dict:
    return {k: v for k, v in {"redis_url": redis, "prefix": prefix}.items() if v is not None}
console, err = output_console(), output_console(stderr=True)  # (text as it is: no markup, no control characters)


def _checked_id(value: str | None, what: str) -> str | None:
    """``value`` if :func:`agl_common.schemas.check_rollout_id` accepts it as a ``what``, else a usage error (exit 2;
    bytes that are not UTF-8 were a ``UnicodeEncodeError`` traceback once they reached Redis)."""
    from agl_common.schemas import check_rollout_id

    if value is None:
        return None
    try:
        return check_rollout_id(value, what)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _a_rollout_id(value: str | None) -> str | None:
    """Typer callback of an argument naming one rollout (:func:`_checked_id`)."""
    return _checked_id(value, "rollout id")


def _a_run_id(value: str | None) -> str | None:
    """Typer callback of ``--run``: a run id follows a rollout id's rules (:func:`_checked_id`)."""
    return _checked_id(value, "run id")


#: ``--run`` of ``rollouts list`` and ``rollouts export``: membership from the group registry, not id prefixes.
RunOpt = typer.Option(None, "--run", callback=_a_run_id,
                      help="only the rollouts of this run, its evaluations included (a run id: the name of its "
                      "runs/ directory, or of an eval-... directory)")


def _store(redis: str, prefix: str):
    """The ``Store`` of ``--redis`` / ``--prefix``; a URL or prefix it refuses is a usage error (exit 2)."""
    from agl_common.store import Store

    try:
        return Store(redis, prefix)
    except ValueError as exc:
        err.print(f"invalid --redis / --prefix: {exc}")
        raise typer.Exit(2) from None


def _sigterm_as_interrupt() -> None:
    """Ctrl-C and SIGTERM stop the run, also in the middle of an update (:mod:`agl_trainer.interrupt`)."""
    from .interrupt import install

    install()


LoggerOpt = typer.Option(None, "--logger", help="experiment tracker (repeatable, or comma-separated): console, "
                         "jsonl, tensorboard, wandb, mlflow; replaces the config's `loggers`")


def _with_loggers(cfg, loggers: list[str] | None):
    """``cfg`` with ``loggers`` (if given) after checking each tracker is known and installed (exit 2 if not)."""
    from pydantic import ValidationError

    from .trackers import TrackerMissing, check_trackers

    try:
        if loggers:
            names = [n.strip() for item in loggers for n in item.split(",") if n.strip()]
            cfg = cfg.with_fields(loggers=check_trackers(names))
        check_trackers(cfg.loggers, Path(cfg.out_dir))
    except (ValueError, ValidationError, TrackerMissing) as exc:
        err.print(f"error: {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    return cfg


def _check_task(cfg, train: bool = True) -> None:
    """The config's task file and functions are usable, and (cpu backend) the controller's imports found (one
    line and exit 2 if not), before anything starts."""
    from .tasks import TaskError, check_controller_imports, check_task

    try:
        check_task(cfg, train)
        if cfg.backend != "verl":
            check_controller_imports(cfg)
        try:  # and a run's directory can be made in it (/proc exists, but takes none: a traceback at the start)
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            Path(tempfile.mkdtemp(prefix=".agl-check-", dir=cfg.out_dir)).rmdir()
        except OSError as exc:
            raise TaskError(f"out_dir {cfg.out_dir}: {exc.strerror or exc}") from None
    except TaskError as exc:
        err.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _check_prefix(cfg) -> None:
    """No live gateway or controller serves the prefix the run would start its own gateway on
    (:func:`stack.check_prefix_free`): one line and exit 2 if one does, before anything starts (the last of the
    checks at start)."""
    from .stack import PrefixInUse, check_prefix_free

    try:
        check_prefix_free(cfg)
    except PrefixInUse as exc:
        err.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _run(cfg, resume_dir: Path | None = None) -> None:
    from .cycle import EngineError
    from .lease import TrainerLive
    from .model import ModelFilesError
    from .run import NotResumable, run_training

    _check_task(cfg)
    _check_prefix(cfg)
    _sigterm_as_interrupt()
    try:
        run_training(cfg, console, resume_dir)
    except NotResumable as exc:
        err.print(f"cannot resume: {exc}")
        raise typer.Exit(2) from None
    except (TrainerLive, ModelFilesError) as exc:  # (a trainer that took the prefix after the check at start)
        err.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted: every service this run started has been stopped")
        raise typer.Exit(130) from None
    except EngineError as exc:  # an engine that cannot swap policies (checked at start), or refused a swap
        err.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except TimeoutError as exc:  # DrainTimeout included: a replica that never drains
        err.print(f"error: {exc}\nA replica with calls in flight was still waiting on the engine (a generation "
                  "longer than drain_timeout_s: raise it, or lower rollout_timeout_s, which bounds the calls of the "
                  "gateway a run starts); a late one, or one with none in flight, may be a gateway left from a "
                  "killed run: stop it, or wait 30 s after it dies. Then resume with --resume RUN_DIR; "
                  "`agl-trainer gateway status` lists the replicas.", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@app.command()
def train(config: Path = typer.Argument(..., exists=True, dir_okay=False, help="YAML file of TrainConfig fields"),
          resume: Path = typer.Option(None, exists=True, file_okay=False,
                                      help="continue this run directory from its last checkpoint"),
          backend: str = typer.Option(None, help="cpu or verl (default: the config's `backend` field)"),
          seed: int = typer.Option(None, help="seed of the LoRA initialization, the group order and the "
                                   "mini-batches (default: the config's `seed` field)"),
          logger: list[str] = LoggerOpt, redis: str = RunRedisOpt, prefix: str = RunPrefixOpt):
    """Train with the settings in CONFIG (missing keys take the demo defaults; options override it)."""
    options = {k: v for k, v in {"backend": backend, "seed": seed}.items() if v is not None}
    cfg = _with_loggers(_load_config(config, {**_redis_overrides(redis, prefix), **options}), logger)
    if cfg.backend == "verl":
        _run_verl(cfg, resume)
    else:
        _run(cfg, resume)


def _load_config(path: Path, overrides: dict | None = None, uses_redis: bool = True):
    """The :class:`TrainConfig` in ``path`` (YAML, or a run's ``config.json``) with ``overrides`` applied;
    a file that does not validate: its error and exit 2; ``uses_redis``: its Redis URL will be used (then one whose
    password shows as ``***``, as a run's config.json holds it, is refused: give --redis)."""
    from agl_common.settings import hides_secret, redacted_url
    from pydantic import ValidationError

    from .config import TrainConfig, describe_error

    try:
        cfg = TrainConfig.from_yaml(path)
        cfg = cfg.with_fields(**overrides) if overrides else cfg
        if uses_redis and "***" in cfg.redis_url and redacted_url(cfg.redis_url) == cfg.redis_url:  # password "***"
            raise ValueError("its Redis URL has the password hidden (***, as a run's config.json shows it): give "
                             "the URL with --redis or AGL_REDIS_URL")
        for field, value in cfg.model_dump(mode="json").items():  # config.json hides every URL's secret: a run
            if field != "redis_url" and uses_redis and isinstance(value, str) and hides_secret(value):  # would use ***
                raise ValueError(f"its {field} has a secret hidden (***, as a run's config.json shows it): give it "
                                 f"in a config of your own ({field}: in YAML)")
        return cfg
    except (ValidationError, ValueError) as exc:
        err.print(f"invalid config {path}: {describe_error(exc)}", soft_wrap=True)
        raise typer.Exit(2) from None


def _run_verl(cfg, resume_dir: Path | None) -> None:
    """Run the verl backend in verl's own environment (``.venv-verl``; see docs/verl.md) on ``cfg`` as resolved
    (written to ``<run>/config.resolved.yaml``)."""
    import os
    import subprocess

    from .backends.verl.main import verl_python
    from .run import new_run_id
    from .model import ensure_base_model

    _check_task(cfg)
    if resume_dir is not None:
        from .checkpoint import NotResumable, resume_state
        from .run import check_resumable

        try:
            resume_state(resume_dir)
            check_resumable(cfg, Path(resume_dir))
        except NotResumable as exc:
            err.print(f"cannot resume: {exc}")
            raise typer.Exit(2) from None
    py = verl_python()
    if py is None:
        err.print("no verl environment: run `bash scripts/setup-verl.sh` (creates .venv-verl) or set "
                  "AGL_VERL_PYTHON to a Python that has verl 0.9.1")
        raise typer.Exit(2)
    _check_prefix(cfg)
    with console.status("converting the base model (first run only)..."):
        ensure_base_model(cfg.base_model)
    import yaml

    run_dir = Path(resume_dir) if resume_dir else Path(cfg.out_dir) / new_run_id()
    run_dir.mkdir(parents=True, exist_ok=True)
    # the config as resolved here (CONFIG + --seed, --redis, --prefix, --logger, AGL_REDIS_URL...): the verl side
    # reads this file, not CONFIG again (which dropped every override)
    resolved = run_dir / "config.resolved.yaml"
    # (it holds the Redis URL with its password, which the verl side needs: readable by this user only)
    resolved.touch(mode=0o600)
    resolved.chmod(0o600)
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    argv = [str(py), "-m", "agl_trainer.backends.verl.main", str(resolved), "--run-dir", str(run_dir),
            "--ranks", str(cfg.verl_ranks), "--backend", "verl"]
    argv += ["--resume"] if resume_dir else []
    argv += ["--gpu"] if cfg.verl_device == "cuda" else []
    import agl_common
    import agl_controller
    import agl_gateway
    import agl_trainer

    src = [str(Path(m.__file__).resolve().parents[1]) for m in (agl_common, agl_gateway, agl_controller, agl_trainer)]
    env = {**os.environ, "AGL_MAIN_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(src + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    console.print(f"verl backend: {py} (run {run_dir})")
    proc = subprocess.Popen(argv, env=env)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=60)
        err.print("interrupted: the verl run and every service it started have been stopped")
        raise typer.Exit(130) from None
    if rc:
        raise typer.Exit(rc)


@app.command()
def demo(
    steps: int = typer.Option(None, help="training steps (default from TrainConfig)"),
    out_dir: Path = typer.Option(None, help="where runs are written"),
    engine_url: str = typer.Option(None, help="use this running vLLM instead of starting one"),
    seed: int = typer.Option(None, help="seed of the LoRA initialization, the group order and the mini-batches"),
    logger: list[str] = LoggerOpt,
    redis: str = RunRedisOpt, prefix: str = RunPrefixOpt,
):
    """The CPU main job: SmolLM2-135M + OpenAI Agents SDK arithmetic agent, eval → GRPO → eval."""
    from .config import TrainConfig, describe_error

    from pydantic import ValidationError

    overrides = {k: v for k, v in {"steps": steps, "out_dir": out_dir, "engine_url": engine_url,
                                   "seed": seed}.items() if v is not None}
    try:
        cfg = TrainConfig(**overrides, **_redis_overrides(redis, prefix))
    except (ValidationError, ValueError) as exc:
        err.print(f"invalid option: {describe_error(exc)}", soft_wrap=True)
        raise typer.Exit(2) from None
    _run(_with_loggers(cfg, logger))


@app.command("eval")
def eval_(config: Path = typer.Argument(..., exists=True, dir_okay=False, help="YAML file of TrainConfig fields"),
          policy: str = typer.Option("base", "--policy", help="base, vN (adapters/policy-vN of --run, default the "
                                     "newest run in out_dir that has it) or PATH (a PEFT adapter directory)"),
          n: int = typer.Option(1, "--n", max=1024, help="rollouts per held-out input (pass@k up to k = n)"),
          run: Path = typer.Option(None, "--run", exists=True, file_okay=False, help="run directory for --policy vN"),
          as_json: bool = typer.Option(False, "--json", help="print the result as JSON only"),
          logger: list[str] = LoggerOpt, redis: str = RunRedisOpt, prefix: str = RunPrefixOpt):
    """Run the harness on the held-out inputs without training: accuracy, pass@k, reward distribution."""
    from .evaluation import PolicyNotFound, resolve_policy, result_table, run_eval

    cfg = _with_loggers(_load_config(config, _redis_overrides(redis, prefix)), logger)
    _check_task(cfg, train=False)
    if n < 1:
        err.print(f"--n must be at least 1, got {n}")
        raise typer.Exit(2)
    try:
        pol = resolve_policy(policy, cfg, run)
    except PolicyNotFound as exc:
        err.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _check_prefix(cfg)
    _sigterm_as_interrupt()
    try:
        res = run_eval(cfg, pol, n, output_console(stderr=True) if as_json else console)
    except KeyboardInterrupt:
        err.print("interrupted: every service this evaluation started has been stopped")
        raise typer.Exit(130) from None
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        err.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(res) + "\n")
        return
    console.print(result_table(res, pol))
    console.print(f"JSON: {res['eval_dir']}/eval.json")


@app.command()
def ui(redis: str = RedisOpt, prefix: str = PrefixOpt,
       runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", envvar="AGL_RUNS_DIR",
                                     help="folder holding run directories (runs/<name>/<run-id>/)"),
       host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0: every interface)"),
       port: int = typer.Option(8765, min=1, max=65535, help="port to listen on"),
       tokenizer: str = typer.Option(None, help="tokenizer directory for decoding token ids (default: the "
                                     "demo's base model if cached; 'none': show ids)")):
    """The local web dashboard: runs, steps, groups, rollouts, token-level rows, the gateway now."""
    import uvicorn

    from .ui.server import create_app
    from .ui.traces import load_decoder

    try:
        decoder = load_decoder(tokenizer)
    except (OSError, ValueError) as exc:  # missing, or not a tokenizer (a broken tokenizer.json)
        err.print(f"--tokenizer {tokenizer}: {exc}")
        raise typer.Exit(2) from None
    try:
        check_bind_host(host)
    except ValueError as exc:
        err.print(str(exc))
        raise typer.Exit(2) from None
    if runs_dir.exists() and not runs_dir.is_dir():
        err.print(f"--runs-dir {runs_dir} is a file, not a folder of run directories")
        raise typer.Exit(2) from None
    try:
        app_ = create_app(redis, prefix, runs_dir, decoder)
    except ValueError as exc:  # a Redis URL or prefix the Store refuses
        err.print(f"invalid --redis / --prefix: {exc}")
        raise typer.Exit(2) from None
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    app_.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(host))  # no DNS rebinding on loopback
    if not runs_dir.is_dir():
        err.print(f"no folder {runs_dir} yet: the run list stays empty until a run writes there")
    try:  # bound before it is announced: a port in use was announced, then uvicorn's error and exit 3
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:  # (socket.gaierror included: a name that does not resolve)
        err.print(f"cannot listen on {host} port {port}: {exc.strerror or exc}")
        raise typer.Exit(1) from None
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    console.print(f"AGL dashboard: http://{shown}:{port}/  (runs from {runs_dir.resolve()}, Redis {redacted_url(redis)} "
                  f"prefix {prefix!r}; Ctrl-C stops it)", soft_wrap=True)
    sys.stdout.flush()
    uvicorn.Server(uvicorn.Config(app_, log_level="warning")).run(sockets=[sock])


# ---------------------------------------------------------------------------------------------- rollouts
#: What ends `rollouts create` between two rollouts: Ctrl-C, a supervisor's SIGTERM, the terminal closing (SIGHUP).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@rollouts_app.command("create")
def rollouts_create(
    input_json: str = typer.Option(..., "--input", help="the rollout's input, as a JSON object"),
    n: int = typer.Option(1, min=1, max=100_000, help="rollouts to create (one group)"),
    group: str = typer.Option(None, help="group id (default: the first rollout's id)"),
    rollout_id: str = typer.Option(None, "--id", help="rollout id (with n > 1, suffixed -0, -1...)"),
    redis: str = RedisOpt, prefix: str = PrefixOpt,
):
    """Queue rollouts for the controller; prints their ids."""
    import uuid

    from agl_common.schemas import Rollout, check_rollout_id, parse_input
    from agl_common.store import redis_error_line

    try:
        inp = parse_input(input_json)
    except ValueError as exc:
        err.print(f"invalid --input: {exc}")
        raise typer.Exit(2) from None
    base = uuid.uuid4().hex[:12] if rollout_id is None else rollout_id  # (an empty --id is refused, not replaced)
    ids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
    try:
        for rid in ids:
            check_rollout_id(rid)
    except ValueError as exc:
        err.print(f"invalid --id: {exc}")
        raise typer.Exit(2) from None
    try:
        check_rollout_id(base if group is None else group, "group id")
    except ValueError as exc:
        err.print(f"invalid --group: {exc}")
        raise typer.Exit(2) from None

    created: list[str] = []
    stop = []

    async def main():
        # Ctrl-C or SIGTERM ends the loop between two rollouts, never inside one: a rollout is stored, indexed and
        # queued in steps (its record and the experiment's keys lie in two hash slots), and one cut between them
        # was stored `queuing` in no queue: never run, never listed, its id taken. A second signal (a Redis that does
        # not answer holds one create up to its socket timeout) cuts the create short: the user's way to force.
        loop, before = asyncio.get_running_loop(), {s: signal.getsignal(s) for s in STOP_SIGNALS}
        task = asyncio.current_task()

        def on_signal(sig):
            stop.append(sig)
            if len(stop) > 1:
                task.cancel()

        for sig in [s for s, handler in before.items() if handler is not signal.SIG_IGN]:  # (nohup's SIGHUP stays
            loop.add_signal_handler(sig, on_signal, sig)  # ignored)
        store = _store(redis, prefix)
        try:
            for rid in ids:
                if stop:
                    break
                await store.create_rollout(Rollout(rollout_id=rid, input=inp,
                                                   group_id=base if group is None else group))
                created.append(rid)
        finally:
            for sig, handler in before.items():
                loop.remove_signal_handler(sig)  # (False for one not handled: an ignored one)
                signal.signal(sig, handler)
            await store.close()

    from redis.exceptions import RedisError

    failed = None
    try:
        asyncio.run(main())
    except (ValueError, RedisError) as exc:
        failed = redis_error_line(exc) if isinstance(exc, RedisError) else str(exc)
    except asyncio.CancelledError:  # (a second signal)
        pass
    # every id created is printed, whatever signal comes now: queued already, the user must know them (to run or
    # clean them up); printing thousands took long enough for a signal to cut the list short
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sys.stdout.write("".join(f"{rid}\n" for rid in created))  # (checked ids: nothing to escape)
    sys.stdout.flush()
    if stop:
        err.print(f"interrupted: {len(created)} of {len(ids)} rollout(s) created and queued (printed above), the "
                  "rest not created" + (" (the last one may be stored in part: cut short by a second signal)"
                                        if len(stop) > 1 else ""))
        raise typer.Exit(130)
    if failed is not None:
        err.print(failed + (f" ({len(created)} rollout(s) created before it and queued: printed above)"
                            if created else ""), soft_wrap=True)
        raise typer.Exit(1)


@rollouts_app.command("list")
def rollouts_list(limit: int = typer.Option(100, min=0, help="show the latest this many (0: all)"),
                  as_json: bool = typer.Option(False, "--json"),
                  run: str = RunOpt,
                  redis: str = RedisOpt, prefix: str = PrefixOpt):
    """The latest rollouts with their status, reward and failure."""

    async def main():
        store = _store(redis, prefix)
        try:
            ids = await (store.rollout_ids() if run is None else store.run_rollout_ids(run))
            shown = ids[-limit:] if limit > 0 else ids
            return await store.get_rollouts(shown, skip_missing=True), len(shown), len(ids)
        finally:
            await store.close()

    items, asked, total = asyncio.run(main())
    if asked < total:
        err.print(f"showing the latest {asked} of {total} rollouts (--limit 0 shows all)")
    if len(items) < asked:  # (skip_missing: deleted by hand, or written by another version: `rollouts show` says)
        err.print(f"{asked - len(items)} of them left out: no readable record (`rollouts show ID` says why)")
    if as_json:
        for r in items:
            sys.stdout.write(r.model_dump_json() + "\n")
        return
    table = Table()
    for col in ("rollout", "attempt", "status", "reward", "failure", "group"):
        table.add_column(col)
    for r in items:
        table.add_row(*(printable(x) for x in (r.rollout_id, r.attempt_id, r.status.value,
                                                        "-" if r.reward is None else f"{r.reward:g}",
                                                        r.failure or "", r.group_id or "")))
    console.print(table)


@rollouts_app.command("show")
def rollouts_show(rollout_id: str = typer.Argument(..., callback=_a_rollout_id),
                  as_json: bool = typer.Option(False, "--json"),
                  config: Path = typer.Option(None, "--config", exists=True, dir_okay=False,
                                              help="the run's settings for its rows (its runs/.../config.json, or a "
                                              "train YAML); default: TrainConfig's defaults"),
                  tokenizer: str = typer.Option(None, "--tokenizer", help="a tokenizer directory to classify merge "
                                                "breaks with; default: --config's base_model, else the shipped base "
                                                "model's cached copy if any; none: off"),
                  redis: str = RedisOpt, prefix: str = PrefixOpt):
    """One rollout with its recorded calls and the training rows they make: which calls merged into which row,
    and the merge break (class, offset) that started each later row, then the events its harness posted (the last
    50; ``--json``: one JSON object, every event)."""
    from agl_common.store import RolloutNotFound

    from .ui.traces import EVENTS_SHOWN, analyse, event_lines, load_decoder, run_settings

    cfg = _load_config(config, uses_redis=False) if config is not None else None
    settings = run_settings(cfg.model_dump() if cfg is not None else {})
    what = f"--tokenizer {tokenizer}"
    if tokenizer is None and cfg is not None and cfg.base_model:  # the run's own model, not the shipped one
        tokenizer, what = cfg.base_model, f"the base model's tokenizer ({cfg.base_model})"
    try:
        decoder = load_decoder(tokenizer)
    except (OSError, ValueError) as exc:  # missing, or not a tokenizer (a broken tokenizer.json)
        err.print(f"{what}: {exc}", soft_wrap=True)
        raise typer.Exit(2) from None

    async def main():
        store = _store(redis, prefix)
        try:
            if as_json:  # every event; the text shows how many, and the last EVENTS_SHOWN (read alone)
                full = await store.read_events(rollout_id)
                events = (len(full), full)
            else:
                events = await store.recent_events(rollout_id, EVENTS_SHOWN)
            return await store.get_rollout(rollout_id), await store.read_calls(rollout_id), events
        finally:
            await store.close()

    try:
        rollout, calls, (n_events, events) = asyncio.run(main())
    except RolloutNotFound:
        err.print(f"unknown rollout {repr(rollout_id)}")
        raise typer.Exit(1) from None
    trace = analyse(rollout, calls, settings, decoder)
    rows = [{"row": k, "role": row.role, "seqs": row.seqs, "calls": row.n_calls, "prompt_tokens": len(row.prompt_ids),
             "response_tokens": len(row.response_ids), "sampled_tokens": sum(row.response_mask),
             "merge_break": ({key: trace.breaks[k][key] for key in ("class", "seq", "position", "row_tokens",
                                                                    "prompt_tokens")} if k in trace.breaks else None)}
            for k, row in enumerate(trace.rows)]
    if as_json:
        sys.stdout.write(json.dumps({**rollout.model_dump(mode="json"),
                                     "calls": [c.model_dump(mode="json") for c in calls], "rows": rows,
                                     "events": events}) + "\n")
        return
    console.print(rollout.model_dump(mode="json"))
    for c in calls:
        k = trace.row_of_call.get((c.attempt_id, c.seq))
        into = f" → row {k}" if k is not None else (" (not trained: an earlier attempt)" if c.attempt_id !=
                                                      rollout.attempt_id else " (not trained: unusable)")
        console.print(printable(
            f"call {c.attempt_id}/{c.seq} {c.route} {c.status} prompt={len(c.prompt_token_ids)} "
            f"response={len(c.response_token_ids)} tokens, v{c.model_version}"
            + (f" role {c.role} ({c.model})" if c.role else "") + f", {c.latency_ms:.0f} ms{into}"))
    for r in rows:
        b = r["merge_break"]
        why = (f"merge break before it: {b['class']} at token {b['position']} (call {b['seq']}'s prompt of "
               f"{b['prompt_tokens']} tokens does not extend row {r['row'] - 1}'s {b['row_tokens']})" if b
               else "first call" if r["row"] == 0 else "new row")
        console.print(f"row {r['row']}" + (f" ({r['role']})" if r["role"] else "") +
                      f": calls {', '.join(map(str, r['seqs']))} ({r['calls']} merged), prompt "
                      f"{r['prompt_tokens']} tokens, response {r['response_tokens']} ({r['sampled_tokens']} "
                      f"sampled); {why}")
    if not rows:
        console.print("no training row: no usable call in the current attempt")
    shown = event_lines(events)
    tail = f", the last {len(shown)}:" if len(shown) < n_events else ":" if n_events else ""
    console.print(f"{n_events} event(s) posted by the harness and the controller{tail}")
    for e in shown:
        console.print(printable(f"event {e['attempt']} {e['time']} {e['type']} {e['data']}"))


@rollouts_app.command("export")
def rollouts_export(rollout: str = typer.Option(None, "--rollout", help="only this rollout", callback=_a_rollout_id),
                    run: str = RunOpt,
                    status: str = typer.Option(None, "--status", help="only rollouts in this state: queuing, running, "
                                               "succeeded, failed"),
                    min_reward: float = typer.Option(None, "--min-reward", help="only rollouts with reward >= this"),
                    shape: str = typer.Option("calls", "--shape", help="calls (the records), rows (token ids, "
                                              "response mask, logprobs, advantage: what trains) or messages (SFT "
                                              "chat conversations + tools)"),
                    fmt: str = typer.Option("jsonl", "--format", help="jsonl or parquet (parquet needs --out)"),
                    out: Path = typer.Option(None, "--out", dir_okay=False,
                                             help="write here instead of standard output"),
                    config: Path = typer.Option(None, "--config", exists=True, dir_okay=False,
                                                help="--shape rows: the run's settings (its runs/.../config.json, "
                                                "or a train YAML); default: TrainConfig's defaults"),
                    redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Recorded rollouts as a data set: by default every recorded call as JSON Lines on standard output."""
    import math

    if min_reward is not None and not math.isfinite(min_reward):
        err.print(f"invalid --min-reward: a finite number, got {min_reward!r}")
        raise typer.Exit(2)
    from agl_common.schemas import RolloutStatus
    from agl_common.store import RolloutNotFound

    from .export import ExportError, ExportFilter, ExportStats, collect, write

    try:
        state = RolloutStatus(status) if status is not None else None
    except ValueError:
        err.print(f"invalid --status {repr(status)}: "
                  f"choose {', '.join(s.value for s in RolloutStatus)}")
        raise typer.Exit(2) from None
    if shape not in ("calls", "rows", "messages") or fmt not in ("jsonl", "parquet"):
        err.print(f"invalid --shape {repr(shape)} or --format {repr(fmt)}: "
                  "shapes calls, rows, messages; formats jsonl, parquet")
        raise typer.Exit(2) from None
    if fmt == "parquet" and out is None:
        err.print("--format parquet writes a file: give --out FILE.parquet")
        raise typer.Exit(2) from None
    if out is not None and not out.parent.is_dir():  # (checked before anything is read)
        err.print(f"--out {out}: directory {out.parent} does not exist")
        raise typer.Exit(2) from None
    cfg = _load_config(config, uses_redis=False) if config is not None else None
    stats = ExportStats()
    vocab = None
    if shape == "rows":  # the base model's end-of-turn ids, as training reads them
        from .model import ensure_base_model
        from .ui.traces import load_decoder

        try:
            base = ensure_base_model(cfg.base_model if cfg else None)
            vocab = load_decoder(str(base))
        except (OSError, ValueError) as exc:  # (round 17: a base_model without a tokenizer was a traceback)
            err.print(f"the base model's tokenizer: {exc}", soft_wrap=True)
            raise typer.Exit(2) from None

    async def main():
        store = _store(redis, prefix)
        try:
            return await collect(store, ExportFilter(rollout, run, state, min_reward), shape, cfg, vocab,
                                 stats=stats)
        finally:
            await store.close()

    try:
        records = asyncio.run(main())
        if not stats.rollouts:  # an empty data set is valid, but a filter that matched nothing must not look like one
            err.print("no rollout matched " + (", ".join(f"{k} {repr(v)[:80]}" for k, v in (
                ("--rollout", rollout), ("--run", run), ("--status", status), ("--min-reward", min_reward))
                if v is not None) or "(none recorded under this --prefix)"))
            if out is not None:  # a file there stays as it was: an empty export must not look like a written one
                err.print(f"no record matched the filters: no file written ({out} left as it was)")
                raise typer.Exit(1)
        try:
            write(records, shape, fmt, out, sys.stdout.buffer)
            sys.stdout.flush()
        except OSError as exc:  # --out not writable (/proc/x, a full disk: /dev/full)
            err.print(f"cannot write {str(out) if out is not None else 'to stdout'}: "
                      f"{exc.strerror or str(exc)}")
            raise typer.Exit(1) from None
    except RolloutNotFound:
        err.print(f"unknown rollout {repr(rollout)}")
        raise typer.Exit(1) from None
    except ExportError as exc:
        err.print(str(exc))
        raise typer.Exit(1) from None
    if stats.rollouts and (out is not None or stats.skipped_calls):
        skipped = ", ".join(f"{n} {k}" for k, n in stats.skipped_calls.items())
        err.print(f"{stats.records} {shape} record(s) from {stats.rollouts} rollout(s)"
                  + (f" written to {out}" if out else "") + (f"; calls left out: {skipped}" if skipped else ""))


# ---------------------------------------------------------------------------------------------- gateway
@gateway_app.command("pause")
def gateway_pause(timeout: float = typer.Option(60.0, help="seconds to wait for the drain"),
                  redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Pause every gateway replica; return once all report their in-flight calls drained. Prints the pause's
    id: `gateway resume --pause ID` ends this pause alone (a trainer's own pauses stay held)."""
    import math

    from agl_common.control import DrainTimeout, new_pause_id, pause_and_drain

    if not (math.isfinite(timeout) and timeout > 0):
        err.print(f"invalid --timeout: a number of seconds above 0, got {timeout!r}")
        raise typer.Exit(2)
    pause = new_pause_id()

    async def main():
        store = _store(redis, prefix)
        try:
            return await pause_and_drain(store, pause, timeout)
        finally:
            await store.close()

    # named before it is held: a pause whose CLI is killed outright (SIGKILL) can still be ended alone
    err.print(f"pausing: pause {pause}, waiting up to {timeout:g} s for the drain", highlight=False)
    try:
        replicas = asyncio.run(main())
    except DrainTimeout as exc:
        err.print(str(exc))
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: withdrawn here, whatever pause_and_drain's own withdrawal did
        # (a second signal while asyncio.run cancelled its tasks cancelled that one: the pause stayed held)
        left = _withdraw_pause(redis, prefix, pause)
        if left:
            err.print(f"interrupted: pause {pause} may still be held ({left}); end it with: agl-trainer gateway "
                      f"resume --pause {pause}", highlight=False)
            raise typer.Exit(1) from None
        err.print(f"interrupted: pause {pause} withdrawn", highlight=False)
        raise typer.Exit(130) from None
    console.print(f"paused and drained: {len(replicas)} replica(s); pause {pause} "
                  f"(end it with: agl-trainer gateway resume --pause {pause})")


def _withdraw_pause(redis: str | None, prefix: str | None, pause: str, timeout_s: float = 15.0) -> str | None:
    """End pause ``pause`` (its own resume) and check it is no longer held, with Ctrl-C and SIGTERM ignored meanwhile
    (a clean-up that a second signal cancels leaves a pause held for an hour). ``None`` once it is gone, else why
    it may not be."""
    from agl_common.control import resume
    from agl_common.aio import within

    async def main() -> str | None:
        store = _store(redis, prefix)
        try:
            await resume(store, release=pause)
            return "still listed" if pause in await store.pauses() else None
        finally:
            await store.close()

    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(within(main(), timeout_s))
    except Exception as exc:  # noqa: BLE001 - Redis away, past the timeout: said, with the way to end it
        return f"{type(exc).__name__}: {exc}"[:200]
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@gateway_app.command("resume")
def gateway_resume(model: str = typer.Option(None, help="route new calls to this served model name"),
                   version: int = typer.Option(None, min=0, max=2**63 - 1, help="policy version of that model"),
                   pause: str = typer.Option(None, "--pause", help="end this pause only (the id `gateway pause` "
                                             "printed); without it every pause ends, a trainer's included"),
                   redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Release held calls on every replica: end one pause (--pause ID) or every pause."""
    from agl_common.control import resume
    from agl_common.schemas import check_served_name
    from agl_common.store import UnreadableRecord

    if model is not None and (not model.strip() or version is None):
        err.print("--model needs a non-empty name and its --version (a missing one was published as v0)")
        raise typer.Exit(2)
    if version is not None and model is None:
        err.print("--version needs --model (a version alone names no policy: nothing was published)")
        raise typer.Exit(2)
    try:
        if model is not None:
            check_served_name(model)  # every served name's rule (a config's model_name too)
    except ValueError as exc:
        err.print(f"--model: {exc}")
        raise typer.Exit(2) from None

    async def main():
        store = _store(redis, prefix)
        try:
            try:
                current = await store.get_policy() if model is not None else None
            except UnreadableRecord:  # (another version's, or a hand's): --model replaces it
                current = None
            if model is not None and current is not None and current.roles:
                return "roles", current
            if pause is not None and pause not in await store.pauses():
                return "unknown", sorted(await store.pauses())
            await resume(store, model, version, release=pause, release_all=pause is None)
            return None
        finally:
            await store.close()

    refused = asyncio.run(main())
    if refused and refused[0] == "roles":  # one --model would drop every role's adapter (their calls unrouted)
        err.print(f"the current policy has roles ({printable(', '.join(refused[1].roles))}): --model "
                  "would drop them; resume without --model (a trainer publishes every role's adapter)")
        raise typer.Exit(2)
    if refused:
        held = ", ".join(printable(p) for p in refused[1]) or "none"
        err.print(f"no pause {printable(pause)} is held (held now: {held}); nothing "
                  "was resumed")
        raise typer.Exit(2)
    console.print("resumed")


@gateway_app.command("status")
def gateway_status(redis: str = RedisOpt, prefix: str = PrefixOpt):
    """Live replicas with paused, in-flight and held counts."""

    async def main():
        store = _store(redis, prefix)
        try:
            return await store.replicas(), await store.get_policy()
        finally:
            await store.close()

    replicas, policy = asyncio.run(main())
    shown = lambda x: printable(str(x))  # noqa: E731 - names come from engines and operators
    console.print(f"policy: {shown(policy.model) if policy else '-'} (v{policy.version if policy else 0})"
                  + ("; roles: " + ", ".join(f"{shown(r)} → {shown(m)}" for r, m in policy.roles.items())
                     if policy and policy.roles else ""))
    table = Table()
    for col in ("replica", "paused", "in flight", "held", "model"):
        table.add_column(col)
    for r in replicas:
        table.add_row(shown(r.replica_id), str(r.paused), str(r.in_flight), str(r.held),
                      shown(f"{r.model} v{r.version}"))
    console.print(table)


def _terminate_once(signum, frame) -> None:
    """SIGTERM as Ctrl-C, once: a second SIGTERM (a supervisor repeating itself) must not cut the first one's
    clean-up short (it cancelled `gateway pause`'s withdrawal: the pause stayed held); SIGKILL still ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main() -> None:
    """The ``agl-trainer`` entry point. Not on a terminal (a pipe, a log), progress bars are switched off before
    anything imports tqdm (``TQDM_DISABLE`` is read at import): a bar rewritten in place prints as one huge line
    there, and the run prints a line per event instead. The key and a Redis password are first hidden from
    ``/proc`` (:func:`agl_common.proc_secrets.hide_from_proc`): a harness run by this trainer's controller runs
    as the same user."""
    import os

    from agl_common.proc_secrets import argv_secrets, hide_from_proc, scrub_argv

    args = sys.argv[1:]  # (parsed from this copy: sys.argv itself reaches multiprocessing children)
    secrets = argv_secrets(args)
    hide_from_proc(secrets)  # a harness reads /proc/<pid>/{cmdline,environ}
    scrub_argv(secrets)
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m`: a task or reward module in the working
        sys.path.insert(0, os.getcwd())  # directory imports from the console script too
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    # SIGTERM (`timeout`, systemd, a Job's end, a CI step limit) is Ctrl-C for every command: each command's own
    # clean-up runs (`gateway pause` killed mid-drain left its pause held for an hour, its id never printed)
    signal.signal(signal.SIGTERM, _terminate_once)
    from agl_common.settings import printable_log_records
    from agl_common.store import UnreadableRecord, redis_error_line
    from redis.exceptions import RedisError

    printable_log_records()  # (a Redis server's text in a log line, the lease's warnings: no terminal escapes)
    try:
        app(args=args)
    except RedisError as exc:  # one line, not a traceback: out of reach, refused credentials, out of memory, NOPERM
        err.print(f"error: {redis_error_line(exc)}", soft_wrap=True)
        sys.exit(1)
    except UnreadableRecord as exc:  # a record another version (or a hand) wrote: named, in one line
        err.print(f"error: {exc}", soft_wrap=True)
        sys.exit(1)
