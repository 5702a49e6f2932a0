"""A real Docker engine for tests: start it, build the images once per run, run containers, time each step.

Used by tests/test_docker.py (``pytest -m docker``). The engine comes from scripts/ensure-docker.sh (an
engine that already answers, else Debian's dockerd started as root with its own data root: see that
script), the base image from scripts/build-base-image.sh (Debian bookworm + python3, since no container
registry is reachable here; ``AGL_TEST_BASE_IMAGE=python:3.11-slim`` uses the official one instead).
Images are tagged ``agl-<name>:test``; the engine's layer cache makes a second build in the same run (or
on the same machine) take seconds.
"""

from __future__ import annotations

import functools
import glob
import http.server
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"


def run_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a new session; on ``timeout`` the whole
    process group is killed (``subprocess.run`` alone kills only ``cmd``: a debootstrap it started went on
    running, unowned, through the rest of the suite) and ``TimeoutExpired`` is raised."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Unavailable(Exception):
    """No Docker engine (or no way to get a part) on this machine: the tests skip with this reason."""


class Docker:
    """The engine at ``host`` (a DOCKER_HOST URL) and the steps' durations in seconds (``times``)."""

    def __init__(self, host: str, workdir: Path):
        self.host = host
        self.env = {**os.environ, "DOCKER_HOST": host}
        self.workdir = workdir
        self.times: dict[str, float] = {}
        self.containers: list[str] = []
        self.pidfile: Path | None = None

    @classmethod
    def start(cls, workdir: Path) -> "Docker":
        """Run scripts/ensure-docker.sh; raises Unavailable with its reason when no engine can run."""
        if shutil.which("docker") is None and os.geteuid() != 0:
            raise Unavailable("no docker client, and installing docker.io needs root")
        t0 = time.monotonic()
        res = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-docker.sh")], capture_output=True, text=True,
                             timeout=600)
        if res.returncode == 2:
            raise Unavailable(f"no Docker engine can run here: {res.stderr.strip()[-500:]}")
        assert res.returncode == 0, res.stderr
        d = cls(res.stdout.strip().splitlines()[-1], workdir)
        d.times["engine"] = time.monotonic() - t0
        if m := re.search(r"started dockerd \(pid \d+, pid file (\S+)\)", res.stderr):
            d.pidfile = Path(m[1])  # ours to stop at the end (its images stay on disk: the next start has them)
        return d

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} -> {res.returncode}\n{res.stdout[-3000:]}\n"
                                 f"{res.stderr[-3000:]}")
        return res

    def timed(self, step: str, fn, *args, **kw):
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            self.times[step] = self.times.get(step, 0.0) + time.monotonic() - t0

    # ------------------------------------------------------------------------------------------ images
    def base_image(self) -> str:
        """AGL_TEST_BASE_IMAGE, or the Debian-built base (built once per engine: its tag hashes its recipe)."""
        if os.environ.get("AGL_TEST_BASE_IMAGE"):
            return os.environ["AGL_TEST_BASE_IMAGE"]
        # Not niced: at nice 19 beside two busy processes debootstrap got ~1% of a core and ran past this
        # bound (issue 14); the suite runs one test at a time, so nothing here needs protecting from it.
        # The build runs in its own session: on a timeout the whole group goes, not just bash.
        res = self.timed("base image", run_group, ["bash", str(ROOT / "scripts" / "build-base-image.sh")],
                         env=self.env, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout.strip().splitlines()[-1]

    def build(self, name: str, dockerfile: str, build_args: dict[str, str], context: Path = ROOT,
              tag: str | None = None) -> str:
        """``docker build`` (legacy builder, host network for pip); returns the tag."""
        tag = tag or f"agl-{name}:test"
        args = ["build", "--network", "host", "-f", str(ROOT / dockerfile), "-t", tag]
        for k, v in build_args.items():
            args += ["--build-arg", f"{k}={v}"]
        self.timed(f"build {name}", self, *args, str(context), timeout=1800)
        return tag

    def size_mb(self, tag: str) -> float:
        return int(self("image", "inspect", "--format", "{{.Size}}", tag).stdout) / 1e6

    # ------------------------------------------------------------------------------------------ containers
    def run_detached(self, image: str, *args: str, env: dict[str, str] | None = None,
                     volumes: list[str] = ()) -> str:
        name = f"agl-test-{uuid.uuid4().hex[:8]}"
        opts = ["--name", name, "--network", "host"]
        for k, v in (env or {}).items():
            opts += ["-e", f"{k}={v}"]
        for v in volumes:
            opts += ["-v", v]
        self("run", "-d", *opts, image, *args)
        self.containers.append(name)
        return name

    def inspect(self, name: str, fmt: str) -> str:
        return self("inspect", "--format", fmt, name).stdout.strip()

    def logs(self, name: str) -> str:
        res = self("logs", name, check=False)
        return res.stdout + res.stderr

    def cleanup(self) -> None:
        """Remove our containers; stop the engine if we started it (AGL_KEEP_DOCKER=1 keeps it running)."""
        for name in self.containers:
            self("rm", "-f", name, check=False)
        self.containers.clear()
        if self.pidfile is not None and not os.environ.get("AGL_KEEP_DOCKER"):
            try:
                pid = int(self.pidfile.read_text())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                return
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)


@functools.lru_cache(maxsize=1)
def torch_wheel() -> str | None:
    """The CPU torch wheel pip finds locally (PIP_FIND_LINKS folders), or None."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split() + ["/opt/wheels"]
    for d in dirs:
        d = d.removeprefix("file://")
        found = glob.glob(os.path.join(d, TORCH_WHEEL))
        if found:
            return found[0]
    return None


class WheelIndex:
    """A PEP 503-style index of one local wheel over HTTP on 127.0.0.1 (pip's --extra-index-url), in a thread.

    The trainer image's CPU torch comes from download.pytorch.org by default; the CI machines cannot
    reach it, so the test serves the wheel pip already has locally (the one scripts/setup.sh installs).
    """

    PORT = 18765

    def __init__(self, wheel: str, workdir: Path):
        root = workdir / "torch-index"
        (root / "torch").mkdir(parents=True, exist_ok=True)
        link = root / "torch" / Path(wheel).name
        if not link.exists():
            link.symlink_to(wheel)
        handler = functools.partial(_QuietHandler, directory=str(root))
        # A fixed port when free: the URL is a build argument, and a new one would invalidate the image's cache.
        try:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.PORT), handler)
        except OSError:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class RedisServer:
    """A redis-server of our own on a free loopback port (no persistence), for one test module."""

    def __init__(self, workdir: Path, port: int):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=20)
