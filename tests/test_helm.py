"""The Helm charts with a real helm (``pytest -m helm``; part of the default run).

scripts/ensure-helm.sh fetches a pinned static helm v3.17.2 when none is on PATH. For every chart:
`helm lint --strict` and `helm template` with its defaults and with every `helm install` command that
docs/deploy.md shows (its --set flags and -f values files, as written), Helm validating the values
against values.schema.json; every rendered object is checked against the Kubernetes OpenAPI schema through
the official client's generated models (unknown fields, types, required fields). The controller's k8s
runner then runs, against the fake API server (tests/fake_k8s.py), with the Job template of the rendered
ConfigMap, and every API request it makes must be allowed by the rendered Role, and everything the Role
grants must be used. No Kubernetes API server runs here (docs/deploy.md, "Not verified here").
"""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.helm
ROOT = Path(__file__).resolve().parent.parent
CHARTS = ["agl-gateway", "agl-controller", "agl-trainer"]
NAMESPACE = "agl"


@pytest.fixture(scope="session")
def helm() -> str:
    res = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-helm.sh")], capture_output=True, text=True,
                         timeout=300)
    if res.returncode == 2:
        pytest.skip(f"no helm binary: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def docs_helm_installs() -> list[list[str]]:
    """The arguments after `helm install` of every such command in docs/deploy.md's shell blocks."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("helm install "):
                out.append(shlex.split(line)[2:])
    return out


def chart_of(args: list[str]) -> str:
    return Path(args[1]).name


CASES = [(c, ["agl", f"helm/{c}"]) for c in CHARTS] + [(chart_of(a), a) for a in docs_helm_installs()]
# More branches of the templates: the chart's own Redis, the HPA, k8s mode with a Job template of one's own.
CASES += [("agl-gateway", ["agl", "helm/agl-gateway", "--set", "redis.enabled=true", "--set", "autoscaling.enabled=true",
                           "--set", "auth.existingSecret=", "--set", "auth.key=k"]),
          ("agl-controller", ["agl", "helm/agl-controller", "--set", "controller.mode=k8s", "--set-file",
                              "job.template=helm/agl-controller/files/job-template.yaml.j2"])]


def run(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert not check or res.returncode == 0, res.stdout + res.stderr
    return res


def render(helm: str, args: list[str]) -> list[dict]:
    out = run(helm, "template", *args, "--namespace", NAMESPACE).stdout
    return [d for d in yaml.safe_load_all(out) if d]


QUANTITY_MAPS = {"limits", "requests", "capacity", "hard"}


def _quantities_as_strings(node, key=None):
    """Kubernetes quantities are int-or-string in the OpenAPI schema; the client's models type them as str."""
    if isinstance(node, dict):
        if key in QUANTITY_MAPS:
            return {k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in node.items()}
        return {k: _quantities_as_strings(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_quantities_as_strings(v) for v in node]
    return node


def validate_object(obj: dict) -> None:
    """``obj`` against the client's model for its apiVersion and kind (e.g. apps/v1 Deployment: V1Deployment)."""
    from agl_controller.k8s import validate_manifest

    version = obj["apiVersion"].split("/")[-1]
    validate_manifest(_quantities_as_strings(obj), version.capitalize() + obj["kind"],
                      what=f"{obj['kind']} {obj['metadata']['name']}")


def test_docs_show_a_helm_install_for_every_chart():
    assert {chart_of(a) for a in docs_helm_installs()} == set(CHARTS)


@pytest.mark.parametrize("chart,args", CASES, ids=[" ".join(a[1:]) for _, a in CASES])
def test_lint_and_template_validate_against_the_kubernetes_schema(helm, chart, args):
    run(helm, "lint", "--strict", *args[1:])
    objs = render(helm, args)
    assert objs
    for obj in objs:
        validate_object(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "agl"
    kinds = {o["kind"] for o in objs}
    assert {"agl-gateway": "Deployment", "agl-controller": "Deployment", "agl-trainer": "Job"}[chart] in kinds


def test_bad_values_are_rejected_by_helm_with_the_schema(helm):
    for args in (["--set", "replicaCount=0"], ["--set", "gateway.upstream=vllm:8000"], ["--set", "redis.enabled=yes"],
                 ["--set", "redis.persistence.size=8GB"], ["--set", "resources.limits.cpu=true"]):
        res = run(helm, "template", "agl", "helm/agl-gateway", *args, check=False)
        assert res.returncode != 0 and "values don't meet the specifications of the schema" in res.stderr, args
    res = run(helm, "template", "agl", "helm/agl-controller", "--set", "controller.mode=remote", check=False)
    assert res.returncode != 0 and "schema" in res.stderr


def test_gateway_renders_offline_with_external_redis_by_default(helm):
    meta = yaml.safe_load((ROOT / "helm" / "agl-gateway" / "Chart.yaml").read_text())
    assert "dependencies" not in meta  # nothing to fetch: renders with no network
    objs = render(helm, ["agl", "helm/agl-gateway"])
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AGL_REDIS_URL"] == "redis://redis:6379/0"
    assert not [o for o in objs if o["kind"] == "StatefulSet"]


def test_gateway_chart_redis_is_persistent_and_not_selected_by_the_gateway_service(helm):
    objs = render(helm, ["agl-gateway", "helm/agl-gateway", "--set", "redis.enabled=true"])
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    sts = by[("StatefulSet", "agl-gateway-redis")]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--appendonly" in c["args"] and c["volumeMounts"][0]["mountPath"] == "/data"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AGL_REDIS_URL"] == "redis://agl-gateway-redis:6379/0"

    def selects(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    redis_pod = sts["spec"]["template"]["metadata"]["labels"]
    gateway_pod = dep["spec"]["template"]["metadata"]["labels"]
    gw_svc, redis_svc = by[("Service", "agl-gateway")], by[("Service", "agl-gateway-redis")]
    assert selects(gw_svc["spec"]["selector"], gateway_pod) and not selects(gw_svc["spec"]["selector"], redis_pod)
    assert selects(redis_svc["spec"]["selector"], redis_pod) and not selects(redis_svc["spec"]["selector"], gateway_pod)
    pdb = by[("PodDisruptionBudget", "agl-gateway")]
    assert not selects(pdb["spec"]["selector"]["matchLabels"], redis_pod)


# ------------------------------------------------------------------------------------------ runner vs RBAC
def rbac_request(method: str, path: str, query: dict) -> tuple[str, str, str, str]:
    """(apiGroup, resource[/subresource], verb, namespace) of one API request, as RBAC sees it."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":  # /api/v1/namespaces/{ns}/{resource}[/{name}[/{sub}]]
        group, rest = "", parts[2:]
    else:  # /apis/{group}/{version}/namespaces/...
        group, rest = parts[1], parts[3:]
    assert rest[0] == "namespaces", f"cluster-wide request {path}"
    ns, resource, name, sub = rest[1], rest[2], (rest[3:4] or [None])[0], (rest[4:5] or [None])[0]
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or (
            "delete" if name else "deletecollection")
    return group, resource + (f"/{sub}" if sub else ""), verb, ns


def test_the_k8s_runner_needs_exactly_what_the_chart_grants(helm, redis_url, prefix):
    """The runner, with the Job template from the rendered ConfigMap, against the fake API server."""
    from agl_common.schemas import CallRecord, Rollout, RolloutStatus
    from agl_common.store import Store
    from agl_controller.k8s import K8sRunner

    from fake_k8s import FakeK8s

    objs = render(helm, ["agl-controller", "helm/agl-controller", "--set", "controller.mode=k8s"])
    by_kind = {o["kind"]: o for o in objs}
    role, binding, sa = by_kind["Role"], by_kind["RoleBinding"], by_kind["ServiceAccount"]
    dep = by_kind["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]} and role["metadata"]["namespace"] == NAMESPACE
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["AGL_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    template = by_kind["ConfigMap"]["data"]["job-template.yaml.j2"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}

    async def scenario() -> list[dict]:
        store = Store(redis_url, prefix)
        with FakeK8s() as fake:
            runner = K8sRunner(store, "http://agl-gateway:8080", template, "agl-policy", namespace=NAMESPACE,
                               key="k", api_client=fake.api_client(), watch=True, reconcile_every_s=0.2, poll_s=0.05)
            stop = asyncio.Event()
            task = asyncio.create_task(runner.run_forever(stop))
            for rid in ("ok", "cancelled"):
                await store.create_rollout(Rollout(rollout_id=rid, input={"question": "1+1"}))
            for _ in range(600):
                if len(fake.job_names(NAMESPACE)) == 2 or task.done():
                    break
                await asyncio.sleep(0.05)
            assert len(fake.job_names(NAMESPACE)) == 2, task.exception() if task.done() else fake.requests
            await store.record_call(CallRecord(rollout_id="ok", attempt_id="0", seq=-1, route="chat", request={},
                                               response={"choices": [{"message": {"content": "2"}}]}))

            def reward(r: Rollout) -> None:
                r.reward = 1.0
            await store.update_rollout("ok", reward)
            fake.set_condition("agl-ok-0", "Complete", ns=NAMESPACE)

            def cancel(r: Rollout) -> None:
                r.status, r.failure = RolloutStatus.failed, "cancelled"
            await store.update_rollout("cancelled", cancel)
            for _ in range(200):
                if (await store.get_rollout("ok")).status == RolloutStatus.succeeded and \
                        "agl-cancelled-0" not in fake.job_names(NAMESPACE):
                    break
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(task, 30)
            await store.close()
            ok = await Store(redis_url, prefix).get_rollout("ok")
            assert ok.status == RolloutStatus.succeeded, (ok.failure, ok.reward)
            assert "agl-cancelled-0" not in fake.job_names(NAMESPACE)
            used = {rbac_request(m, p, q) for (m, p), q in zip(fake.requests, fake.queries)}
            return used, [j for j in fake.jobs.values()]

    used, jobs = asyncio.run(scenario())
    assert {ns for *_, ns in used} == {NAMESPACE}
    used = {(g, r, v) for g, r, v, _ in used}
    assert used <= granted, f"the runner needs what the Role does not grant: {used - granted}"
    assert granted <= used, f"the Role grants what the runner never uses: {granted - used}"
    for job in jobs:  # what the runner created from the chart's template: a valid Job in the release namespace
        validate_object(job)
        assert job["metadata"]["namespace"] == NAMESPACE
        spec = job["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
        assert spec.get("serviceAccountName") != sa["metadata"]["name"]  # harness pods never get the Role


def test_the_engines_key_comes_from_a_secret_in_the_gateway_and_the_trainer(helm):
    """(Left open by round 19.) An engine that asks for a key (vLLM ``--api-key``) could not be used from the charts:
    neither the gateway nor the trainer (which loads each adapter into the engine) got ``AGL_UPSTREAM_KEY``. With
    ``engineKey.existingSecret`` both read it from that Secret, never as a plain value; by default it is unset."""
    for chart, kind in (("agl-gateway", "Deployment"), ("agl-trainer", "Job")):
        def env_of(*args):
            (obj,) = [o for o in render(helm, ["agl", f"helm/{chart}", *args]) if o["kind"] == kind]
            validate_object(obj)
            return {e["name"]: e for e in obj["spec"]["template"]["spec"]["containers"][0].get("env", [])}

        assert "AGL_UPSTREAM_KEY" not in env_of()
        got = env_of("--set", "engineKey.existingSecret=vllm-key")["AGL_UPSTREAM_KEY"]
        assert got == {"name": "AGL_UPSTREAM_KEY", "valueFrom": {"secretKeyRef": {"name": "vllm-key", "key": "key"}}}
        run(helm, "lint", "--strict", f"helm/{chart}", "--set", "engineKey.existingSecret=vllm-key")
