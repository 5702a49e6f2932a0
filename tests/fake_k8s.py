"""A tiny fake Kubernetes API server for controller tests (real HTTP on 127.0.0.1, in a thread).

Implements only what the Kubernetes runner calls, with the API server's shapes:
``POST/GET /apis/batch/v1/namespaces/{ns}/jobs`` (list with ``labelSelector`` equality terms, and
``watch=true`` as a chunked stream of JSON-line events, starting with ADDED for existing objects unless a
``resourceVersion`` is given), ``DELETE .../jobs/{name}``, and ``GET /api/v1/namespaces/{ns}/pods``.
Errors are ``Status`` objects (409 AlreadyExists, 404 NotFound). Tests drive Job and pod states with
:meth:`FakeK8s.set_condition` and :meth:`FakeK8s.add_pod`.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from kubernetes import client


def _matches(labels: dict, selector: str | None) -> bool:
    for term in (selector or "").split(","):
        if term:
            k, _, v = term.partition("=")
            if labels.get(k) != v:
                return False
    return True


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeK8s:
    """State: jobs and pods by (namespace, name); an event log for watches; every request seen."""

    def __init__(self):
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.requests: list[tuple[str, str]] = []
        self.queries: list[dict[str, str]] = []  # the query of each request, in the same order
        self.rv = 0
        self.lock = threading.Lock()
        self.closing = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str):
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                parts = url.path.strip("/").split("/")
                fake.requests.append((method, url.path))
                fake.queries.append(q)
                body = None
                if method == "POST":
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                elif self.headers.get("Content-Length"):
                    self.rfile.read(int(self.headers["Content-Length"]))
                if parts[:3] == ["apis", "batch", "v1"] and len(parts) >= 5 and parts[5:6] == ["jobs"]:
                    ns = parts[4]
                    name = parts[6] if len(parts) > 6 else None
                    if method == "POST":
                        return self._send(*fake.create_job(ns, body))
                    if method == "DELETE" and name:
                        return self._send(*fake.delete_job(ns, name))
                    if method == "GET" and name:
                        job = fake.job(name, ns)
                        return self._send(200, job) if job is not None else \
                            self._send(404, _status(404, "NotFound", f'jobs.batch "{name}" not found'))
                    if method == "GET" and name is None:
                        if q.get("watch") == "true":
                            return self._watch(ns, q)
                        return self._send(200, fake.list("jobs", ns, q.get("labelSelector"), "JobList",
                                                         "batch/v1"))
                if parts[:2] == ["api", "v1"] and parts[4:5] == ["pods"] and method == "GET":
                    return self._send(200, fake.list("pods", parts[3], q.get("labelSelector"), "PodList", "v1"))
                return self._send(404, _status(404, "NotFound", f"no route {method} {url.path}"))

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, ns: str, q: dict) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                selector = q.get("labelSelector")
                deadline = time.monotonic() + float(q.get("timeoutSeconds", 30))
                with fake.lock:
                    if q.get("resourceVersion"):
                        sent = int(q["resourceVersion"])
                        pending = []
                    else:
                        sent = fake.rv
                        pending = [("ADDED", copy.deepcopy(j)) for (n, _), j in fake.jobs.items() if n == ns]
                try:
                    while time.monotonic() < deadline and not fake.closing:
                        with fake.lock:
                            new = [(rv, t, o) for rv, t, o in fake.events if rv > sent]
                        for rv, t, o in new:
                            sent = rv
                            if o["metadata"]["namespace"] == ns:
                                pending.append((t, o))
                        for t, o in pending:
                            if _matches(o["metadata"].get("labels") or {}, selector):
                                self._chunk(json.dumps({"type": t, "object": o}).encode() + b"\n")
                        pending = []
                        time.sleep(0.05)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_DELETE(self):
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # ---------------------------------------------------------------- server side
    def _event(self, type_: str, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, type_, copy.deepcopy(obj)))

    def create_job(self, ns: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            name = body["metadata"]["name"]
            if (ns, name) in self.jobs:
                return 409, _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
            body["metadata"].update(namespace=ns, uid=str(uuid.uuid4()),
                                    creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            body["status"] = {"active": 1}
            self.jobs[(ns, name)] = body
            self._event("ADDED", body)
            return 201, copy.deepcopy(body)

    def delete_job(self, ns: str, name: str) -> tuple[int, dict]:
        with self.lock:
            job = self.jobs.pop((ns, name), None)
            if job is None:
                return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
            for key in [k for k, p in self.pods.items() if p["metadata"]["labels"].get("job-name") == name]:
                del self.pods[key]
            self._event("DELETED", job)
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}

    def list(self, kind: str, ns: str, selector: str | None, list_kind: str, api_version: str) -> dict:
        with self.lock:
            objs = self.jobs if kind == "jobs" else self.pods
            items = [copy.deepcopy(o) for (n, _), o in objs.items()
                     if n == ns and _matches(o["metadata"].get("labels") or {}, selector)]
            return {"kind": list_kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(self.rv)},
                    "items": items}

    # ---------------------------------------------------------------- test helpers
    def job(self, name: str, ns: str = "default") -> dict | None:
        with self.lock:
            return copy.deepcopy(self.jobs.get((ns, name)))

    def job_names(self, ns: str = "default") -> list[str]:
        with self.lock:
            return sorted(n for (s, n) in self.jobs if s == ns)

    def set_condition(self, name: str, type_: str, reason: str | None = None, ns: str = "default") -> None:
        """Finish a Job: ``type_`` is ``Complete`` or ``Failed``."""
        with self.lock:
            job = self.jobs[(ns, name)]
            cond = {"type": type_, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            if reason:
                cond["reason"] = reason
            job["status"] = {"conditions": [cond], ("succeeded" if type_ == "Complete" else "failed"): 1}
            self._event("MODIFIED", job)

    def add_pod(self, job: str, status: dict, ns: str = "default") -> None:
        """A pod of ``job`` with the Job's pod labels plus ``job-name``, and the given ``status``."""
        with self.lock:
            tmpl = self.jobs[(ns, job)]["spec"]["template"]
            labels = {**tmpl["metadata"]["labels"], "job-name": job, "batch.kubernetes.io/job-name": job}
            name = f"{job}-{uuid.uuid4().hex[:5]}"
            self.pods[(ns, name)] = {"apiVersion": "v1", "kind": "Pod",
                                     "metadata": {"name": name, "namespace": ns, "labels": labels},
                                     "spec": copy.deepcopy(tmpl["spec"]), "status": status}

    # ---------------------------------------------------------------- lifecycle
    def api_client(self) -> client.ApiClient:
        """An official ``ApiClient`` pointed at this server."""
        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def __enter__(self) -> FakeK8s:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing = True
        self.server.shutdown()
        self.server.server_close()
