"""A real Redis Cluster on loopback for tests and benchmarks: 3 masters + 3 replicas from ``redis-server``.

Each node is a ``redis-server --cluster-enabled yes`` on a free port below the kernel's ephemeral range (its
bus port, +10000, free too), with
``cluster-node-timeout`` 1000 ms (a replica takes over ~1-2 s after its master dies) and
``cluster-require-full-coverage no`` (the slots of live masters stay writable meanwhile). The nodes are
joined by ``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``. Nothing persists: each node
gets its own directory under a temporary one, deleted by :meth:`LocalCluster.stop`.

    .venv/bin/python scripts/local_redis_cluster.py        # prints the URL, runs until Ctrl-C

Used by the ``redis_cluster`` fixture in tests/conftest.py and by bench/store_cluster.py.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from agl_trainer.services import free_port

NODE_TIMEOUT_MS = 1000


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now whose cluster bus ports (+10000) are free too, all below the kernel's
    ephemeral range (:func:`agl_trainer.services.free_port`): a killed node is restarted on its port later."""
    return [free_port(plus=10000) for _ in range(n)]


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on loopback.

    Raises ``RuntimeError`` (with the nodes' log tails) if the cluster is not up within ``timeout_s``;
    ``FileNotFoundError`` if ``redis-server`` or ``redis-cli`` is missing.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = NODE_TIMEOUT_MS):
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"{tool} is not installed (Debian package redis-server)")
        self.n = masters * (1 + replicas)
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="agl-redis-cluster-"))
        self.ports = free_ports(self.n)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`` (every node, so any one can seed the client)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _start_node(self, port: int) -> None:
        d = self.dir / str(port)
        d.mkdir(exist_ok=True)
        with open(d / "redis.log", "ab") as log:
            self.procs[port] = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no",
                 "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=port, socket_connect_timeout=1).ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline or self.procs[port].poll() is not None:
                    raise RuntimeError(f"redis-server on {port} did not start: {self.log_tail(port)}") from None
                time.sleep(0.05)

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        try:
            for p in self.ports:
                self._start_node(p)
            subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def nodes(self) -> list[dict]:
        """``CLUSTER NODES`` of a live node, one dict per node: ``port``, ``master`` (bool), ``alive``."""
        for p in self.ports:
            if self.procs.get(p) is None or self.procs[p].poll() is not None:
                continue
            try:
                raw = redis.Redis(port=p, socket_connect_timeout=1, decode_responses=True).execute_command(
                    "CLUSTER", "NODES")
            except redis.RedisError:
                continue
            text = raw if isinstance(raw, str) else "\n".join(
                f"{v['node_id']} {k} {v['flags']} {v.get('master_id', '-')}" for k, v in raw.items())
            out = []
            for line in text.strip().splitlines():
                f = line.split()
                flags = f[2].split(",")
                out.append({"port": int(f[1].split("@")[0].rsplit(":", 1)[1]), "master": "master" in flags,
                            "alive": not ({"fail", "fail?", "noaddr"} & set(flags))})
            return out
        raise RuntimeError("no cluster node answers")

    def masters(self) -> list[int]:
        return sorted(n["port"] for n in self.nodes() if n["master"] and n["alive"])

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok`` and every live replica's link to its master is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ok = True
                for p, proc in self.procs.items():
                    if proc.poll() is not None:
                        continue
                    r = redis.Redis(port=p, socket_connect_timeout=1, decode_responses=True)
                    if "cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
                        ok = False
                    rep = r.info("replication")
                    if rep["role"] == "slave" and rep.get("master_link_status") != "up":
                        ok = False
                if ok and len(self.masters()) * (1 + self.replicas) >= len(
                        [p for p in self.procs.values() if p.poll() is None]):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not healthy after {timeout_s} s: {self.log_tail(self.ports[0])}")
            time.sleep(0.1)

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown, nothing flushed to its replica)."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def restart(self, port: int) -> None:
        """Start a killed node again; it rejoins from its nodes.conf (as a replica if it was failed over)."""
        self._start_node(port)

    def wait_failover(self, old_master: int, timeout_s: float = 30.0) -> int:
        """Until a replica of ``old_master`` is master of its slots; returns the new master's port."""
        before = set(self.masters()) - {old_master}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = set(self.masters()) - before - {old_master}
            if new:
                return new.pop()
            time.sleep(0.05)
        raise RuntimeError(f"no replica of {old_master} took over within {timeout_s} s")

    def log_tail(self, port: int, n: int = 2000) -> str:
        path = self.dir / str(port) / "redis.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    with LocalCluster() as c:
        print(c.url, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
