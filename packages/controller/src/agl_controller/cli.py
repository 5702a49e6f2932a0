"""``agl-controller run --mode local|k8s ...``"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import jinja2
import typer
from agl_common.settings import (DEFAULT_PREFIX, DEFAULT_REDIS_URL, check_gateway_url, check_prefix, command_argv,
                                 redacted_url)
from jinja2.sandbox import ImmutableSandboxedEnvironment
from redis.exceptions import RedisError

from .base import DEFAULT_RETRY_ON, ControllerIdLive, check_controller_id, check_retry_on, load_reward_fn
from .local import DEFAULT_MAX_LOG_BYTES, NEVER_PASSED
from .spawn import LaunchError

#: the longest --timeout / --lease-ttl (s): Redis takes a lease in ms, Kubernetes an int32 deadline
MAX_SECONDS = 10**7
#: the shortest --lease-ttl (s): it is renewed every third of it, and a busy machine delays a renewal by more
#: than 50 ms (then a second controller would take a live one's runs)
MIN_LEASE_TTL = 1.0

app = typer.Typer(add_completion=False, help="AGL controller: one harness run per rollout.")


def check_gateway_key(gateway: str, key: str | None) -> None:
    """Raise ``ValueError`` if ``key`` could not be a gateway's (not printable ASCII), or if the gateway answers
    ``GET /v1/models`` with 401 to this controller's ``key`` (none:
    the gateway has an admin key and this controller none; a key: it is not the gateway's). Either way every
    harness would get a key the gateway refuses, and each rollout would fail ``no_model_calls`` (the agent's own
    failure, never retried). A gateway not answering yet is not checked (it may start after this controller)."""
    import httpx

    if key is not None and not (key and key.isascii() and key.isprintable() and key.strip() == key):
        raise ValueError("--key / AGL_KEY must be printable ASCII without spaces around (as the gateway's is: it "
                         "travels in an HTTP header)")
    try:
        status = httpx.get(gateway.rstrip("/") + "/v1/models", timeout=3,
                           headers={"Authorization": f"Bearer {key}"} if key else None).status_code
    except httpx.HTTPError:
        return
    if status == 401 and not key:
        raise ValueError(f"the gateway at {redacted_url(gateway)} has an admin key (401) and this controller none: "
                         "every run's calls would be refused; give it --key / AGL_KEY (the gateway's)")
    if status == 401:
        raise ValueError(f"the gateway at {redacted_url(gateway)} refused this controller's key (401): --key / "
                         "AGL_KEY is not the gateway's admin key, and every run's calls would be refused")


#: Secrets this command reads as options (``--key``, ``--redis``), dropped from its environment once read; the other
#: names of :data:`NEVER_PASSED` (the engine's key, which no controller reads) are dropped by :func:`main` before
#: parsing, so that a command run in-process (the tests) leaves the engine key its caller holds.
OPTION_SECRETS = ("AGL_KEY", "AGL_REDIS_URL")


#: the options only one mode reads (parameter name → mode); the other mode would ignore them
MODE_ONLY = {"command": "local", "preload": "local", "pass_env": "local", "log_dir": "local",
             "max_log_bytes": "local", "run_as": "local", "template": "k8s", "namespace": "k8s",
             "jobs_per_minute": "k8s", "ttl_after_finished": "k8s", "input_templates": "k8s", "inputs": "k8s"}


def check_mode_options(ctx: typer.Context, mode: str) -> list[str]:
    """The options of ``ctx`` given for the mode other than ``mode``, which ``mode`` would ignore. One given on
    the command line raises ``ValueError`` (the user meant it: a k8s ``--namespace`` with ``--mode local`` must
    not run harnesses here as if it applied); one from the environment (a deployment's shared variables) is
    returned as a warning line. What counts is where an option came from, not its value: one not given is not
    counted, one given is, even at its default value (``--namespace default`` with ``--mode local``)."""
    warnings = []
    for name, only in MODE_ONLY.items():
        if only == mode or mode not in ("local", "k8s"):
            continue
        source = getattr(ctx.get_parameter_source(name), "name", None)  # (typer's own click: compared by name)
        param = next(p for p in ctx.command.params if p.name == name)
        flag = max(param.opts, key=len)
        if source == "COMMANDLINE":
            raise ValueError(f"{flag} is a {only}-mode option: --mode {mode} would ignore it")
        if source == "ENVIRONMENT":
            warnings.append(f"warning: {param.envvar} ({flag}) is a {only}-mode option: ignored in {mode} mode")
    return warnings


def _csv(text: str | None) -> list[str]:
    return [m.strip() for m in (text or "").split(",") if m.strip()]



def _say(text: str) -> None:
    """One message on stderr, its control characters but newlines escaped (:func:`agl_common.settings.printable`: a
    Redis server's error text or a user's URL held terminal escapes)."""
    from agl_common.settings import printable

    typer.echo(printable(text, "\n"), err=True)

@app.callback()
def _main() -> None:
    """AGL controller."""


@app.command()
def run(
    ctx: typer.Context,
    command: str = typer.Option(None, "--command", envvar="AGL_COMMAND", help="harness command line (local mode)"),
    mode: str = typer.Option("local", envvar="AGL_MODE", help="local | k8s"),
    gateway: str = typer.Option("http://127.0.0.1:8080", envvar="AGL_GATEWAY_URL", help="gateway base URL"),
    model: str = typer.Option("agl-policy", envvar="AGL_MODEL", help="model name handed to the harness"),
    redis: str = typer.Option(DEFAULT_REDIS_URL, envvar="AGL_REDIS_URL"),
    prefix: str = typer.Option(DEFAULT_PREFIX, envvar="AGL_PREFIX"),
    concurrency: int = typer.Option(4, envvar="AGL_CONCURRENCY", min=1, help="most runs (local) or Jobs (k8s) at once"),
    timeout: float = typer.Option(300.0, envvar="AGL_TIMEOUT", help="seconds per run (k8s: activeDeadlineSeconds)"),
    key: str = typer.Option(None, envvar="AGL_KEY", help="gateway admin key (to derive scoped keys)"),
    reward_fn: str = typer.Option(None, envvar="AGL_REWARD_FN", help="module:function(input, output) -> float"),
    reward_fn_always: bool = typer.Option(False, "--reward-fn-always", envvar="AGL_REWARD_FN_ALWAYS",
                                          help="the reward function scores every run, replacing a reward the "
                                               "harness posted (default: only runs that posted none)"),
    log_dir: str = typer.Option("runs/logs", envvar="AGL_LOG_DIR"),
    max_log_bytes: int = typer.Option(DEFAULT_MAX_LOG_BYTES, envvar="AGL_MAX_LOG_BYTES", min=1,
                                      help="local: most bytes of one run's log; past it the run is stopped, "
                                           "failure log_limit"),
    max_attempts: int = typer.Option(1, envvar="AGL_MAX_ATTEMPTS", min=1, max=100,
                                     help="attempts per rollout (1: no retry; at most 100)"),
    retry_on: str = typer.Option(",".join(DEFAULT_RETRY_ON), envvar="AGL_RETRY_ON",
                                 help="comma-separated failure reasons that are retried"),
    controller_id: str = typer.Option(None, envvar="AGL_CONTROLLER_ID",
                                      help="stable name (e.g. the pod name): a restart adopts its own claims at once"),
    lease_ttl: float = typer.Option(15.0, envvar="AGL_LEASE_TTL", help="seconds without renewal until presumed dead"),
    template: str = typer.Option(None, envvar="AGL_JOB_TEMPLATE", help="k8s: Jinja template file of the Job"),
    input_templates: bool = typer.Option(False, "--input-templates", envvar="AGL_INPUT_TEMPLATES",
                                         help="k8s: a rollout may bring its own Job template "
                                              "(input['agl_job_template']); off: such a rollout fails"),
    namespace: str = typer.Option("default", envvar="AGL_NAMESPACE", help="k8s namespace"),
    jobs_per_minute: int = typer.Option(60, envvar="AGL_JOBS_PER_MINUTE", min=1, help="k8s: Job creation limit"),
    ttl_after_finished: int = typer.Option(3600, envvar="AGL_TTL_AFTER_FINISHED", min=0, max=2**31 - 1,
                                           help="k8s: ttlSecondsAfterFinished of each Job"),
    preload: str = typer.Option(None, "--preload", envvar="AGL_PRELOAD",
                                help="local, Python harnesses: comma-separated modules imported once; each run is "
                                     "forked from that warm interpreter instead of started anew"),
    pass_env: str = typer.Option(None, "--pass-env", envvar="AGL_PASS_ENV",
                                 help="local: comma-separated names (or globs like MY_*) of this controller's "
                                      "variables each run gets; by default a run gets only PATH, HOME, locale and "
                                      "the like, plus the contract's variables (never AGL_KEY or AGL_REDIS_URL)"),
    run_as: str = typer.Option(None, "--run-as", envvar="AGL_RUN_AS",
                               help="local: Unix users the runs become, one per concurrent run (comma-separated "
                                    "names, uids, and ranges FIRST-LAST of uids without users), so that a harness "
                                    "reads neither this controller's memory, nor its user's files, nor another run; "
                                    "every process of a run's user is ended with the run; needs root"),
    dry_run: bool = typer.Option(False, "--dry-run", help="k8s: print the rendered Job manifests and exit"),
    inputs: list[str] = typer.Option(None, "--input", help="k8s --dry-run: a rollout input as JSON (repeatable); "
                                                             "default: the rollouts now queued in Redis"),
) -> None:
    """Run queued rollouts until SIGINT/SIGTERM."""
    from agl_common.settings import printable_log_records
    from agl_common.store import Store, check_redis_url

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    printable_log_records()  # (a Redis server's or a harness's text in a log line drives no terminal)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (its INFO lines print each request's URL, secrets too)
    # the admin key and the Redis URL (with its password) live on in this process's memory only (read into the
    # options above): no child (a harness, a forkserver started again, a process a reward or preload module starts
    # when it is imported by the checks below) inherits them from the environment
    for name in OPTION_SECRETS:
        os.environ.pop(name, None)
    retry = tuple(r.strip() for r in retry_on.split(",") if r.strip())
    try:  # checked before anything starts: a bad option is a usage error (exit 2), not a traceback
        check_retry_on(retry)
        check_prefix(prefix)
        check_redis_url(redis)
        check_gateway_url(gateway, "--gateway")
        if command:
            argv = command_argv(command)  # an unclosed quote, nothing to run: ValueError
            if mode == "local" and shutil.which(argv[0]) is None:
                raise ValueError(f"--command: program {argv[0]!r} not found (on PATH, or as a path from "
                                 f"{os.getcwd()}); every run would fail as spawn_error")
            if mode == "local":
                from .spawn import check_command

                try:
                    check_command(argv, found=True)
                except LaunchError as exc:
                    raise ValueError(f"--command: {exc}; every run would fail") from None
        if reward_fn:
            load_reward_fn(reward_fn)
        if not (0 < timeout <= MAX_SECONDS):  # (NaN fails too) beyond: Redis and Kubernetes refuse the value
            raise ValueError(f"--timeout must be a number of seconds in (0, {MAX_SECONDS}], got {timeout}")
        if not (MIN_LEASE_TTL <= lease_ttl <= MAX_SECONDS):  # shorter: a live controller's lease lapses between
            raise ValueError(f"--lease-ttl must be a number of seconds in [{MIN_LEASE_TTL}, {MAX_SECONDS}], "
                             f"got {lease_ttl} (a shorter lease lapses while its controller lives: another one "
                             "would end its runs as controller_lost)")
        if controller_id is not None:
            check_controller_id(controller_id)
        for line in check_mode_options(ctx, mode):
            _say(line)
        if not dry_run:
            check_gateway_key(gateway, key)
    except ValueError as exc:
        _say(f"error: {exc}")
        raise typer.Exit(2) from None
    if reward_fn_always and not reward_fn:
        _say("error: --reward-fn-always needs --reward-fn")
        raise typer.Exit(2)
    common = dict(reward_fn=reward_fn, max_attempts=max_attempts, retry_on=retry, controller_id=controller_id,
                  lease_ttl_s=lease_ttl, reward_fn_always=reward_fn_always)
    if mode == "local":
        if not command:
            _say("--command is required in local mode")
            raise typer.Exit(2)
        if dry_run:
            _say("--dry-run renders Kubernetes Jobs: it needs --mode k8s (a local run would take the queue)")
            raise typer.Exit(2)
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _say(f"--log-dir {log_dir}: {exc.strerror or exc}")
            raise typer.Exit(2) from None
        from .local import passed_env
        from .spawn import Launcher, check_user_runs, harness_users

        try:
            passed_env({}, _csv(pass_env))
        except ValueError as exc:
            _say(f"error: {exc}")
            raise typer.Exit(2) from None
        if run_as is not None:
            try:
                for user in harness_users(run_as, concurrency):
                    check_user_runs(user, shlex.split(command), os.getcwd())
            except LaunchError as exc:
                _say(f"--{exc}")
                raise typer.Exit(2) from None

        try:  # checked before anything starts: a command preload cannot fork is a usage error
            Launcher(shlex.split(command), _csv(preload))
        except LaunchError as exc:
            _say(f"--preload: {exc}")
            raise typer.Exit(2) from None
    elif mode == "k8s":
        if not template:
            _say("--template is required in k8s mode")
            raise typer.Exit(2)
        try:
            with open(template) as f:
                template_text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            _say(f"--template {template}: {exc}")
            raise typer.Exit(2) from None
        try:  # a template that does not parse would fail every rollout as template_error
            ImmutableSandboxedEnvironment().parse(template_text)
        except jinja2.TemplateSyntaxError as exc:
            _say(f"--template {template}: line {exc.lineno}: {exc.message}")
            raise typer.Exit(2) from None
        if dry_run:
            with one_line_errors():
                code = _dry_run(template_text, gateway, model, key, namespace, ttl_after_finished, timeout,
                                prefix, redis, inputs or [], input_templates)
            raise typer.Exit(code)
    else:
        _say(f"unknown mode {mode!r}: use local or k8s")
        raise typer.Exit(2)

    async def main() -> None:
        store = Store(redis, prefix)
        if mode == "local":
            from .local import LocalRunner

            runner = LocalRunner(store, gateway, command, model, concurrency=concurrency, timeout_s=timeout, key=key,
                                 log_dir=log_dir, preload=_csv(preload), pass_env=_csv(pass_env),
                                 max_log_bytes=max_log_bytes, run_as=run_as, **common)
        else:
            from .k8s import K8sRunner, load_api_client

            try:
                api_client = load_api_client()
            except Exception as exc:  # noqa: BLE001 - no in-cluster account and no usable kubeconfig
                raise NoCluster(f"no Kubernetes cluster to run Jobs on ({type(exc).__name__}: {exc})") from None
            runner = K8sRunner(store, gateway, template_text, model, namespace=namespace, key=key,
                               concurrency=concurrency, jobs_per_minute=jobs_per_minute,
                               ttl_after_finished_s=ttl_after_finished, timeout_s=timeout,
                               api_client=api_client, input_templates=input_templates, **common)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await runner.run_forever(stop)
        finally:
            runner.close()
            await store.close()

    with one_line_errors():
        asyncio.run(main())


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Redis out of reach or refusing a command (exit 1), a live controller under this id or run-as users in use
    (exit 2): one line, not a traceback."""
    try:
        yield
    except RedisError as exc:
        from agl_common.store import redis_error_line

        _say(f"error: {redis_error_line(exc)}")
        raise typer.Exit(1) from None
    except (ControllerIdLive, NoCluster, LaunchError) as exc:  # (LaunchError: run-as users another controller holds)
        _say(f"error: {exc}")
        raise typer.Exit(2) from None


class NoCluster(RuntimeError):
    """``--mode k8s`` found no cluster configuration."""


def _dry_run(template_text: str, gateway: str, model: str, key: str | None, namespace: str, ttl: int,
             timeout: float, prefix: str, redis: str, inputs: list[str], input_templates: bool = False) -> int:
    """Print the manifests (YAML, ``---``-separated) for ``inputs`` or the queued rollouts; 0 if all valid."""
    import yaml
    from agl_common.schemas import Rollout, parse_input

    from .k8s import JobRenderer

    # a printed manifest is a log: its scoped keys are derived from a stand-in, never from the admin key (they would
    # be the working keys of the queued rollouts' first attempts)
    renderer = JobRenderer(template_text, gateway, model, key="dry-run-not-the-admin-key" if key else None,
                           namespace=namespace, ttl_after_finished_s=ttl, timeout_s=timeout, prefix=prefix,
                           input_templates=input_templates)
    if inputs:
        try:
            rollouts = [Rollout(rollout_id=f"dry-run-{i}", input=parse_input(raw)) for i, raw in enumerate(inputs)]
        except ValueError as exc:  # not strict JSON, not an object (as `rollouts create --input` refuses it)
            _say(f"--input: {str(exc).splitlines()[0]}")
            return 2
    else:
        from agl_common.store import Store

        async def queued() -> list[Rollout]:
            store = Store(redis, prefix)
            try:
                ids = await store.queued_ids()
                return await store.get_rollouts(list(reversed(ids)), skip_missing=True)
            finally:
                await store.close()

        rollouts = asyncio.run(queued())
    code = 0
    for rollout in rollouts:
        try:
            manifest = renderer.render(rollout)
        except ValueError as exc:
            _say(f"# rollout {rollout.rollout_id}: {exc}")
            code = 1
            continue
        typer.echo("---\n" + yaml.safe_dump(manifest, sort_keys=False), nl=False)
    return code


def main() -> None:
    """The ``agl-controller`` entry point: the admin key and a Redis password are hidden from ``/proc`` first
    (:func:`agl_common.proc_secrets.hide_from_proc`; this process also made non-dumpable): every local harness
    runs as this process's user."""
    from agl_common.proc_secrets import argv_secrets, hide_from_proc, scrub_argv

    args = sys.argv[1:]  # (parsed from this copy: sys.argv itself reaches multiprocessing children)
    secrets = argv_secrets(args)
    hide_from_proc(secrets, dumpable=False)  # a harness reads /proc/<pid>/{cmdline,environ}
    scrub_argv(secrets)
    for name in sorted(NEVER_PASSED - set(OPTION_SECRETS)):  # (never read by this process: see OPTION_SECRETS)
        os.environ.pop(name, None)
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` and uvicorn: a --reward-fn, --preload
        sys.path.insert(0, os.getcwd())  # or task module in the working directory imports from the console script too
    app(args=args)
