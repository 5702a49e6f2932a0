"""The Kubernetes runner: one Job per rollout attempt, rendered from a Jinja template.

The template (``--template FILE``, or a rollout's own ``input["agl_job_template"]``) is Jinja2 text that
renders to one YAML Job manifest; it sees ``input``, ``rollout`` (the record as a dict), ``rollout_id``,
``attempt_id``, ``job_name``, ``model``, ``namespace`` and ``env`` (the CONTRACT §2 variables). Undefined
variables are errors. The runner then fixes what it owns, whatever the template says:

- ``metadata.name``: :func:`job_name` (idempotent: the same attempt always gets the same name, so a
  create after a crash answers 409 AlreadyExists instead of starting a second run); ``namespace``;
- labels ``app.kubernetes.io/managed-by=agl-controller``, ``agl.dev/experiment`` (hash of the Redis
  prefix), ``agl.dev/rollout`` (the id, or a safe form of it), ``agl.dev/attempt`` on the Job and its
  pods; annotation ``agl.dev/rollout-id`` with the exact id;
- ``spec.backoffLimit: 0`` (a retry is a new attempt, never a pod restart inside one),
  ``spec.ttlSecondsAfterFinished``, ``spec.activeDeadlineSeconds`` (the run timeout, unless set),
  ``restartPolicy: Never``;
- the CONTRACT §2 environment (plus ``env_map``) in every container and init container, replacing
  variables of the same name.

The manifest is then validated with the official client's models (unknown or mistyped fields are
errors). A Job's outcome (:func:`job_outcome`):

================================================  ======================
Job / pod state                                   failure
================================================  ======================
condition Complete                                none (then calls and reward are checked)
a container terminated with reason OOMKilled      ``oom_killed``
a container waiting on ErrImagePull and friends   ``image_pull`` (the Job is deleted)
pod evicted                                       ``evicted``
condition Failed, reason DeadlineExceeded         ``deadline_exceeded``
condition Failed, a container exited N ≠ 0        ``exit_code:N``
condition Failed, anything else                   ``job_failed:{reason}``
a running rollout's Job vanished                  ``job_lost`` (after ``job_lost_after_s``)
================================================  ======================

Jobs whose rollout is gone, finished (cancelled) or on another attempt are deleted while active.
The runner watches its Jobs (label selector) to react at once, and reconciles everything every
``reconcile_every_s`` seconds in any case. Its Kubernetes calls are the synchronous official client,
run in threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
import yaml
from agl_common.aio import within
from agl_common.schemas import Rollout, RolloutStatus
from agl_common.store import RolloutNotFound, Store

from .base import DEFAULT_RETRY_ON, Runner
from .local import harness_env

log = logging.getLogger("agl.controller.k8s")

MANAGED_BY = "app.kubernetes.io/managed-by"
EXPERIMENT = "agl.dev/experiment"
ROLLOUT_LABEL = "agl.dev/rollout"
ATTEMPT_LABEL = "agl.dev/attempt"
ROLLOUT_ANNOTATION = "agl.dev/rollout-id"
TEMPLATE_FIELD = "agl_job_template"
IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}

_LABEL_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _hash(text: str, n: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


#: The hash a changed rollout id's Job name carries: 16 hex digits (64 bits), beyond a search for a second id of the
#: same hash (32 bits were: a few seconds of a C loop).
JOB_HASH_DIGITS = 16
_HASHED = re.compile(rf"(.*-)?[0-9a-f]{{{JOB_HASH_DIGITS}}}")  # (alone too: the name of an id with nothing kept)


def job_name(rollout_id: str, attempt_id: str) -> str:
    """``agl-{rollout}-{attempt}`` as a DNS-1123 label (lower-case alphanumerics and '-', ≤ 63 chars).

    When the id had to be changed (other characters, or too long), a hash of the exact id
    (:data:`JOB_HASH_DIGITS` hex digits) is added before the attempt; an id that already ends as such a hash
    does (16 hex digits, alone or after a ``-``: ``_``'s name is ``agl-{hash}-0``) is hashed too, so that no id kept
    as it is can take a changed id's name.
    Distinct rollouts never share a name short of a 64-bit hash collision, and
    :meth:`K8sRunner.launch` checks whose Job an existing name holds.
    """
    base = re.sub(r"[^a-z0-9-]+", "-", rollout_id.lower()).strip("-")
    name = f"agl-{base}-{attempt_id}"
    if base == rollout_id and len(name) <= 63 and not _HASHED.fullmatch(rollout_id):
        return name
    suffix = f"-{_hash(rollout_id, JOB_HASH_DIGITS)}-{attempt_id}"
    return ("agl-" + base[: 63 - 4 - len(suffix)]).rstrip("-") + suffix


def label_value(text: str) -> str:
    """``text`` if it is a valid label value (≤ 63 chars), else a safe prefix of it plus a hash."""
    if len(text) <= 63 and _LABEL_RE.match(text):
        return text
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:50].rstrip("-_.")
    return f"{safe}-{_hash(text)}" if safe else _hash(text)


def validate_job(manifest: dict[str, Any]):
    """Parse ``manifest`` into the official client's ``V1Job`` and return it.

    Raises ``ValueError`` for a field of the wrong type, a missing required one (e.g. a container
    without ``name``), no containers, or a key the model does not know (see :func:`validate_manifest`).
    """
    job = validate_manifest(manifest, "V1Job", what="Job manifest")
    if job.spec is None or job.spec.template.spec is None or not job.spec.template.spec.containers:
        raise ValueError("invalid Job manifest: spec.template.spec.containers is empty")
    return job


def validate_manifest(manifest: dict[str, Any], model: str, what: str = "manifest"):
    """Parse ``manifest`` (a dict) into the official client's model ``model`` (e.g. ``"V1Job"``) and return it.

    The client's models are generated from the Kubernetes OpenAPI schema. Raises ``ValueError`` for a field
    of the wrong type, a missing required one, or a key the model does not know (found by comparing the
    manifest with the model's own serialization).
    """
    from kubernetes.client import ApiClient

    client = ApiClient()
    try:
        obj = client.deserialize(json.dumps(manifest), model, "application/json")
    except Exception as exc:  # pydantic ValidationError, TypeError...
        raise ValueError(f"invalid {what}: {exc}") from exc
    unknown = _unknown_keys(manifest, client.sanitize_for_serialization(obj))
    if unknown:
        raise ValueError(f"invalid {what}: unknown field(s) {', '.join(unknown)}")
    return obj


def _unknown_keys(given: Any, parsed: Any, path: str = "") -> list[str]:
    if isinstance(given, dict):
        parsed = parsed if isinstance(parsed, dict) else {}
        out = []
        for k, v in given.items():
            if k not in parsed:
                if v is not None:
                    out.append(f"{path}.{k}".lstrip("."))
            else:
                out += _unknown_keys(v, parsed[k], f"{path}.{k}")
        return out
    if isinstance(given, list) and isinstance(parsed, list):
        return [u for i, (g, p) in enumerate(zip(given, parsed)) for u in _unknown_keys(g, p, f"{path}[{i}]")]
    return []


class _JSON(str):
    """What this environment's ``tojson`` filter wrote: JSON, kept as it is by :func:`_as_yaml_scalar`. A string
    method called on it gives a plain ``str`` (JSON-encoded again), unlike ``markupsafe.Markup``, which ``| e``,
    ``| safe``, ``| forceescape`` and ``| xmlattr`` return too: a rollout's input through ``| e`` kept its newlines
    and added ``hostPID: true`` to the pod spec (round 23)."""


def _tojson(value: Any, indent: int | None = None) -> _JSON:
    """The ``tojson`` filter of Job templates: ``value`` as JSON (a YAML flow value)."""
    return _JSON(json.dumps(value, indent=indent))


def _as_yaml_scalar(value: Any) -> Any:
    """Jinja ``finalize``: a value as JSON (which YAML reads as one flow value, whatever it holds: ``"2}}, x: 1"``
    stays a string); what ``tojson`` already wrote (:class:`_JSON`, that type exactly) is kept. Raises ``TypeError``
    for a value JSON cannot hold (the rollout's template_error)."""
    if type(value) is _JSON:
        return value
    return json.dumps(value)


class JobRenderer:
    """Renders and completes the Job manifest of one rollout attempt (see the module docstring).

    Args:
        template: Jinja2 text of the Job (YAML).
        gateway_url, model, key: as for the local runner (the environment of CONTRACT §2).
        namespace: where the Jobs go.
        ttl_after_finished_s: ``spec.ttlSecondsAfterFinished`` (s).
        timeout_s: ``spec.activeDeadlineSeconds`` (s) unless the template sets it; ``None``: none.
        prefix: the Redis key prefix; its hash labels the Jobs of this experiment.
        input_templates: honour a rollout's own ``input["agl_job_template"]`` (off by default: whoever writes a
            rollout's input, a task file's row included, would choose the pod that runs it and its security).

    Templates render in Jinja2's immutable sandbox: a template (the operator's or a rollout's) reaches no Python
    object beyond the values it is given (``{{ cycler.__init__.__globals__ }}`` is a ``SecurityError``). Every
    ``{{ expression }}`` is written as JSON (:func:`_as_yaml_scalar`: a YAML flow value; ``| tojson`` output as it
    is, and only it: ``| e`` or ``| safe`` output is JSON-encoded as any string), so no value (a rollout's input above all) can change the manifest's structure: write
    ``cpu: {{ input.cpus }}``, ``image: {{ "repo/" ~ input.image }}``, never a ``{{ }}`` inside quotes.
    """

    def __init__(self, template: str, gateway_url: str, model: str, key: str | None = None,
                 namespace: str = "default", ttl_after_finished_s: int = 3600, timeout_s: float | None = None,
                 prefix: str = "agl:", input_templates: bool = False):
        self.env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False,
                                                 keep_trailing_newline=True, finalize=_as_yaml_scalar)
        self.env.filters["tojson"] = _tojson
        self.input_templates = input_templates
        self.template = template
        self.gateway_url, self.model, self.key = gateway_url, model, key
        self.namespace = namespace
        self.ttl_after_finished_s = ttl_after_finished_s
        self.timeout_s = timeout_s
        self.experiment = _hash(prefix, 12)

    @property
    def selector(self) -> str:
        """Label selector of every Job (and pod) of this experiment."""
        return f"{MANAGED_BY}=agl-controller,{EXPERIMENT}={self.experiment}"

    def render(self, rollout: Rollout) -> dict[str, Any]:
        """The complete, validated manifest (a dict, camelCase keys). Raises ``ValueError`` on any error."""
        name = job_name(rollout.rollout_id, rollout.attempt_id)
        env = harness_env(self.gateway_url, rollout, self.model, self.key)
        own = rollout.input.get(TEMPLATE_FIELD)
        if own is not None and not self.input_templates:
            raise ValueError(f"input[{TEMPLATE_FIELD!r}] is set but this controller does not take a rollout's own "
                             "Job template (agl-controller run --input-templates)")
        if own is not None and not isinstance(own, str):
            raise ValueError(f"input[{TEMPLATE_FIELD!r}] is not a string")
        text = own or self.template
        try:
            rendered = self.env.from_string(text).render(
                input=rollout.input, rollout=rollout.model_dump(mode="json"), rollout_id=rollout.rollout_id,
                attempt_id=rollout.attempt_id, job_name=name, model=self.model, namespace=self.namespace, env=env)
            manifest = yaml.safe_load(rendered)
        except Exception as exc:  # noqa: BLE001 — a template's {{ 1/0 }} too: every failure is this rollout's
            raise ValueError(f"cannot render the Job template: {type(exc).__name__}: {exc}") from exc
        if not isinstance(manifest, dict):
            raise ValueError("the Job template must render to one YAML mapping")
        try:
            self._complete(manifest, rollout, name, env)
        except (AttributeError, TypeError, KeyError) as exc:  # `metadata: 5`, `spec: [1]`, `env: ['x']`...
            raise ValueError(f"the Job template has the wrong shape: {type(exc).__name__}: {exc}") from exc
        validate_job(manifest)
        return manifest

    def _complete(self, m: dict[str, Any], rollout: Rollout, name: str, env: dict[str, str]) -> None:
        labels = {MANAGED_BY: "agl-controller", EXPERIMENT: self.experiment,
                  ROLLOUT_LABEL: label_value(rollout.rollout_id), ATTEMPT_LABEL: rollout.attempt_id}
        m["apiVersion"], m["kind"] = "batch/v1", "Job"
        meta = m.setdefault("metadata", {}) or {}
        m["metadata"] = meta
        meta.pop("generateName", None)
        meta["name"], meta["namespace"] = name, self.namespace
        meta["labels"] = {**(meta.get("labels") or {}), **labels}
        meta["annotations"] = {**(meta.get("annotations") or {}), ROLLOUT_ANNOTATION: rollout.rollout_id}
        spec = m.setdefault("spec", {}) or {}
        m["spec"] = spec
        # one attempt is one pod, run once: a retry is a new attempt, never a second pod of this one (which would
        # share its scoped key, interleave its calls and post a second reward)
        for key, allowed in (("parallelism", (None, 1)), ("completions", (None, 1)),
                             ("completionMode", (None, "NonIndexed")), ("podFailurePolicy", (None,)),
                             ("backoffLimitPerIndex", (None,)), ("maxFailedIndexes", (None,)),
                             ("successPolicy", (None,))):
            if spec.get(key) not in allowed:
                raise ValueError(f"spec.{key} {spec[key]!r:.60} would run one attempt in several pods or again: "
                                 "a Job runs one pod once (a retry is a new attempt: --max-attempts)")
        spec["parallelism"], spec["completions"] = 1, 1
        spec["backoffLimit"] = 0
        spec["ttlSecondsAfterFinished"] = int(self.ttl_after_finished_s)
        if self.timeout_s and "activeDeadlineSeconds" not in spec:
            spec["activeDeadlineSeconds"] = max(1, int(self.timeout_s))
        tmpl = spec.setdefault("template", {}) or {}
        spec["template"] = tmpl
        tmeta = tmpl.setdefault("metadata", {}) or {}
        tmpl["metadata"] = tmeta
        tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels}
        pod = tmpl.setdefault("spec", {}) or {}
        tmpl["spec"] = pod
        pod["restartPolicy"] = "Never"
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            if not isinstance(c, dict):
                continue
            c["env"] = [e for e in (c.get("env") or []) if e.get("name") not in env]
            c["env"] += [{"name": k, "value": v} for k, v in env.items()]
            for part in ("limits", "requests"):  # YAML `cpu: 1` is a quantity too
                q = (c.get("resources") or {}).get(part)
                if isinstance(q, dict):
                    c["resources"][part] = {k: _quantity(v, f"resources.{part}.{k}") for k, v in q.items()}


#: A non-negative Kubernetes quantity, as the API server parses one (apimachinery's ``resource.Quantity``: a
#: number, then a binary suffix, a decimal suffix or a decimal exponent); ASCII only.
QUANTITY = re.compile(r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?", re.ASCII)


def _quantity(value: Any, where: str) -> str:
    """``value`` as a Kubernetes quantity string (``1``, ``500m``, ``2Gi``), in the API server's grammar
    (:data:`QUANTITY`); ``ValueError`` (a template error) for anything else: a list, null, ``true``, ``NaN``,
    ``inf``, ``1_000`` or a full-width digit rendered there became the API's 422 at every attempt (a
    ``spawn_error`` retried for nothing)."""
    text = str(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str) or not QUANTITY.fullmatch(text):
        raise ValueError(f"{where} {text!r:.40} is not a quantity (a number or a string such as 500m, 2Gi)")
    return text


def job_outcome(job, pods: Iterable[Any]) -> tuple[bool, str | None]:
    """``(ended, failure)`` of a Job (``V1Job``) given its pods (``V1Pod``); see the module table.

    ``ended`` is False while the Job may still succeed; ``failure`` is ``None`` for a Complete Job.
    """
    conds = {c.type: c for c in (job.status.conditions if job.status and job.status.conditions else [])
             if c.status == "True"}
    if "Complete" in conds:
        return True, None
    exit_code = None
    for pod in pods:
        status = pod.status
        if status is None:
            continue
        if status.reason == "Evicted":
            return True, "evicted"
        for cs in (status.init_container_statuses or []) + (status.container_statuses or []):
            state = cs.state
            if state and state.waiting and state.waiting.reason in IMAGE_PULL:
                return True, "image_pull"
            term = (state.terminated if state else None) or (cs.last_state.terminated if cs.last_state else None)
            if term and term.reason == "OOMKilled":
                return True, "oom_killed"
            if term and term.exit_code and exit_code is None:
                exit_code = term.exit_code
    failed = conds.get("Failed") or conds.get("FailureTarget")
    if failed is None:
        return False, None
    if failed.reason == "DeadlineExceeded":
        return True, "deadline_exceeded"
    if exit_code is not None:
        return True, f"exit_code:{exit_code}"
    return True, f"job_failed:{failed.reason or 'unknown'}"


def _is_active(job) -> bool:
    conds = job.status.conditions if job.status and job.status.conditions else []
    return not any(c.type in ("Complete", "Failed") and c.status == "True" for c in conds)


class RateLimit:
    """At most ``per_minute`` events in any 60-second window."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self.times: collections.deque[float] = collections.deque()

    def allow(self, now: float | None = None) -> bool:
        """True (and counted) if one more event fits now."""
        now = time.monotonic() if now is None else now
        while self.times and now - self.times[0] >= 60.0:
            self.times.popleft()
        if len(self.times) >= self.per_minute:
            return False
        self.times.append(now)
        return True


def load_api_client():
    """An ``ApiClient`` from the in-cluster service account, else from ``~/.kube/config``."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class K8sRunner(Runner):
    """Runs each queued rollout attempt as a Kubernetes Job.

    Args:
        store: the experiment's store.
        gateway_url: the gateway's base URL *as seen from the pods*.
        template: Jinja2 text of the Job manifest (see the module docstring).
        model: the model name handed to the harness.
        namespace: the namespace of the Jobs.
        key: the gateway admin key (scoped keys are derived from it).
        concurrency: most Jobs of this controller at once (claimed and not yet finished).
        jobs_per_minute: most Job creations in any 60 s.
        ttl_after_finished_s: ``ttlSecondsAfterFinished`` of each Job (s).
        timeout_s: ``activeDeadlineSeconds`` (s) unless the template sets one.
        api_client: a ``kubernetes.client.ApiClient`` (default: :func:`load_api_client`).
        poll_s: seconds between launch rounds when nothing happens.
        reconcile_every_s: seconds between full reconciliations (the watch wakes it earlier).
        job_lost_after_s: a running rollout without its Job this long after it started fails ``job_lost``.
        watch: also watch Jobs to react at once.
        reward_fn, max_attempts, retry_on, controller_id, lease_ttl_s, reward_fn_always: see
            :class:`~agl_controller.base.Runner`.
    """

    def __init__(self, store: Store, gateway_url: str, template: str, model: str, namespace: str = "default",
                 key: str | None = None, concurrency: int = 100, jobs_per_minute: int = 60,
                 ttl_after_finished_s: int = 3600, timeout_s: float | None = None, api_client=None,
                 poll_s: float = 1.0, reconcile_every_s: float = 10.0, job_lost_after_s: float = 60.0,
                 watch: bool = True, reward_fn: str | None = None, max_attempts: int = 1,
                 retry_on: Iterable[str] = DEFAULT_RETRY_ON, controller_id: str | None = None,
                 lease_ttl_s: float = 15.0, input_templates: bool = False, reward_fn_always: bool = False):
        super().__init__(store, reward_fn=reward_fn, max_attempts=max_attempts, retry_on=retry_on,
                         controller_id=controller_id, lease_ttl_s=lease_ttl_s, reward_fn_always=reward_fn_always,
                         reward_timeout_s=timeout_s or 300.0)  # a reward function gets a run's time at most
        from kubernetes import client

        self.renderer = JobRenderer(template, gateway_url, model, key=key, namespace=namespace,
                                    ttl_after_finished_s=ttl_after_finished_s, timeout_s=timeout_s,
                                    prefix=store.prefix, input_templates=input_templates)
        self.namespace = namespace
        self.concurrency = concurrency
        self.rate = RateLimit(jobs_per_minute)
        self.api_client = api_client or load_api_client()
        self.batch = client.BatchV1Api(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.poll_s = poll_s
        self.reconcile_every_s = reconcile_every_s
        self.job_lost_after_s = job_lost_after_s
        self.watch = watch
        self._wake: asyncio.Event | None = None

    # ---------------------------------------------------------------- main loop
    async def run_forever(self, stop: asyncio.Event) -> None:
        """Launch Jobs for queued rollouts and reconcile their outcomes until ``stop`` is set.

        Jobs keep running when the controller stops; the next controller (same or other id) adopts them.
        """
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if not await self.take_lease(stop):  # stopped while an earlier run's lease lapsed
            return
        lease_stop = asyncio.Event()
        lease_task = asyncio.create_task(self.lease_loop(lease_stop, stop))
        watch_stop = threading.Event()
        watcher = None
        if self.watch:
            watcher = threading.Thread(target=self._watch_jobs, args=(loop, watch_stop), daemon=True)
            watcher.start()
        last_reconcile = 0.0
        try:
            while not stop.is_set():
                try:
                    if self._wake.is_set() or time.monotonic() - last_reconcile >= self.reconcile_every_s:
                        self._wake.clear()
                        last_reconcile = time.monotonic()
                        await self.reconcile_jobs()
                    await self.launch_some()
                except Exception:
                    log.exception("k8s round failed")
                with contextlib.suppress(TimeoutError):
                    await within(self._wait_any(stop, self._wake), self.poll_s)
        finally:
            watch_stop.set()
            lease_stop.set()
            await lease_task
            with contextlib.suppress(Exception):
                await self.store.drop_lease(self.controller_id, owner=self._lease_owner)

    @staticmethod
    async def _wait_any(*events: asyncio.Event) -> None:
        tasks = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()

    def _watch_jobs(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Thread: watch this experiment's Jobs and wake the main loop on every event."""
        from kubernetes import watch

        while not stop.is_set():
            w = watch.Watch()
            try:
                for _ in w.stream(self.batch.list_namespaced_job, self.namespace,
                                  label_selector=self.renderer.selector, timeout_seconds=5):
                    loop.call_soon_threadsafe(self._wake.set)
                    if stop.is_set():
                        w.stop()
            except Exception as exc:  # API server away: the periodic reconcile still runs
                log.debug("job watch failed: %s", exc)
                stop.wait(1.0)

    # ---------------------------------------------------------------- launching
    async def launch_some(self) -> int:
        """Claim queued rollouts and create their Jobs while concurrency and rate allow. Returns how many."""
        n = 0
        while len(await self.store.claimed(self.controller_id)) < self.concurrency:
            if not await self.still_mine():  # (a claim would go to the list of the controller holding our id)
                break
            if not self.rate.allow():
                break
            rid = await self.store.claim_queued(self.controller_id, timeout_s=None)
            if rid is None:
                self.rate.times.pop()  # nothing launched: give the slot back
                break
            await self.launch(rid)
            n += 1
        return n

    async def launch(self, rollout_id: str) -> Rollout | None:
        """Start the claimed rollout's attempt as a Job (an existing Job of that name counts as created)."""
        from kubernetes.client.exceptions import ApiException

        rollout = await self.start_attempt(rollout_id)
        if rollout is None:
            return None
        try:
            manifest = self.renderer.render(rollout)
            job = validate_job(manifest)
        except ValueError as exc:
            log.warning("rollout %s: %s", rollout_id, exc)
            return await self.finish_attempt(rollout_id, rollout.attempt_id, "template_error", check_calls=False)
        try:
            await asyncio.to_thread(self.batch.create_namespaced_job, self.namespace, job)
        except ApiException as exc:
            if exc.status != 409:
                log.warning("cannot create Job for %s: %s %s", rollout_id, exc.status, exc.reason)
                return await self.finish_attempt(rollout_id, rollout.attempt_id, "spawn_error", check_calls=False)
            # 409 AlreadyExists: this attempt's Job, created before a crash, or another's of the same name
            try:
                owner = await self._job_owner(job.metadata.name)
            except Exception as exc:  # noqa: BLE001 - the API server failing the read: followed as ours (a Job
                # of another rollout is then never seen as this one's: job_lost, after job_lost_after_s)
                log.warning("Job %s exists; cannot read whose it is (%s): followed as rollout %s attempt %s's",
                            job.metadata.name, exc, rollout_id, rollout.attempt_id)
                owner = (rollout_id, rollout.attempt_id)
            if owner != (rollout_id, rollout.attempt_id):
                log.warning("cannot create Job %s for rollout %s attempt %s: %s", job.metadata.name, rollout_id,
                            rollout.attempt_id, "it was deleted meanwhile" if owner is None else
                            f"the name is held by rollout {owner[0]!r} attempt {owner[1]}" if owner[0] else
                            "the name is held by a Job made for no rollout")
                return await self.finish_attempt(rollout_id, rollout.attempt_id, "spawn_error", check_calls=False)
        except Exception as exc:  # API server unreachable
            log.warning("cannot create Job for %s: %s", rollout_id, exc)
            return await self.finish_attempt(rollout_id, rollout.attempt_id, "spawn_error", check_calls=False)
        log.info("rollout %s attempt %s: Job %s created", rollout_id, rollout.attempt_id, manifest["metadata"]["name"])
        return rollout

    async def _job_owner(self, name: str, tries: int = 3) -> tuple[str, str] | None:
        """The (rollout id, attempt id) Job ``name`` was made for (its annotation and label; ``("", "")`` for a Job
        made for none), ``None`` if there is no such Job (404). Raises the API server's error (or the client's) if
        ``tries`` reads fail otherwise (a read is tried again after 0.5 s, then 1 s)."""
        from kubernetes.client.exceptions import ApiException

        for attempt in range(tries):
            try:
                existing = await asyncio.to_thread(self.batch.read_namespaced_job, name, self.namespace)
                break
            except ApiException as exc:
                if exc.status == 404:
                    return None
                if attempt + 1 == tries:
                    raise
            except Exception:  # API server unreachable
                if attempt + 1 == tries:
                    raise
            await asyncio.sleep(0.5 * (attempt + 1))
        meta = existing.metadata
        rid = (meta.annotations or {}).get(ROLLOUT_ANNOTATION)
        aid = (meta.labels or {}).get(ATTEMPT_LABEL)
        return (rid, aid) if rid is not None and aid is not None else ("", "")

    async def adopt_running(self, rollout: Rollout) -> None:
        """A dead controller's running rollout: keep the claim; :meth:`reconcile_jobs` follows its Job."""

    # ---------------------------------------------------------------- reconciling
    async def _delete_job(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            await asyncio.to_thread(self.batch.delete_namespaced_job, name, self.namespace,
                                    propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def reconcile_jobs(self) -> None:
        """Bring rollouts and Jobs into agreement (see the module docstring)."""
        jobs = (await asyncio.to_thread(self.batch.list_namespaced_job, self.namespace,
                                        label_selector=self.renderer.selector)).items
        pods = (await asyncio.to_thread(self.core.list_namespaced_pod, self.namespace,
                                        label_selector=self.renderer.selector)).items
        pods_of: dict[str, list] = collections.defaultdict(list)
        for pod in pods:
            labels = pod.metadata.labels or {}
            pods_of[labels.get("batch.kubernetes.io/job-name") or labels.get("job-name") or ""].append(pod)
        mine = set(await self.store.claimed(self.controller_id))
        seen: set[tuple[str, str]] = set()
        for job in jobs:
            meta = job.metadata
            rid = (meta.annotations or {}).get(ROLLOUT_ANNOTATION)
            aid = (meta.labels or {}).get(ATTEMPT_LABEL)
            if rid is None or aid is None:
                continue
            seen.add((rid, aid))
            try:
                rollout = await self.store.get_rollout(rid)
            except RolloutNotFound:
                rollout = None
            current = rollout is not None and rollout.status == RolloutStatus.running and rollout.attempt_id == aid
            if not current:
                if _is_active(job):  # cancelled, finished elsewhere, or a stale attempt
                    log.info("deleting Job %s: rollout %s is not running attempt %s", meta.name, rid, aid)
                    await self._delete_job(meta.name)
                continue
            if rid not in mine:  # another live controller's run
                continue
            ended, failure = job_outcome(job, pods_of.get(meta.name, []))
            if not ended:
                continue
            if _is_active(job):  # decided from a pod (image pull, OOM...): stop what is left
                await self._delete_job(meta.name)
            log.info("rollout %s attempt %s: Job %s ended: %s", rid, aid, meta.name, failure or "ok")
            await self.finish_attempt(rid, aid, failure)
        now = time.time()
        for rid in mine:
            try:
                rollout = await self.store.get_rollout(rid)
            except RolloutNotFound:
                await self.store.release_claim(self.controller_id, rid)
                continue
            if rollout.status == RolloutStatus.running:
                if (rid, rollout.attempt_id) not in seen and now - (rollout.started_at or 0) > self.job_lost_after_s:
                    await self.finish_attempt(rid, rollout.attempt_id, "job_lost", check_calls=False)
            elif rollout.status == RolloutStatus.queuing:
                await self.store.requeue_claim(self.controller_id, rid)
            else:
                await self.store.release_claim(self.controller_id, rid)
