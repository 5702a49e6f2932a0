"""Reward functions for controller tests (``--reward-fn rewards:slow``)."""

import time


def slow(inp: dict, output: str) -> float:
    """A judge that takes ``inp["judge_s"]`` seconds (blocking, as a test run or a model call would)."""
    time.sleep(float(inp.get("judge_s", 2.0)))
    return 1.0


def hostile(inp: dict, output: str):
    """What a careless or hostile reward function returns or does, by ``inp["kind"]``."""
    import sys

    kind = inp["kind"]
    if kind == "exit":
        sys.exit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "generator_exit":
        raise GeneratorExit
    if kind == "hang":
        time.sleep(3600)
    if kind == "os_exit":  # ends its process at once, no handler runs
        import os

        os._exit(3)
    if kind == "alarm":  # a grader's signal-based time limit (works only in a main thread)
        import signal

        signal.signal(signal.SIGALRM, lambda *_: None)
        signal.alarm(30)
        signal.alarm(0)
        return 0.5
    if kind == "chdir":  # a judge that runs tests in another directory and does not come back
        import os

        os.chdir("/")
        return 0.5
    return {"nan": float("nan"), "inf": float("inf"), "big": 1e39, "str": "1_000", "bool": True, "bytes": b"7",
            "hugeint": 10**400,
            "ok": 0.5}[kind]


def zero(inp: dict, output: str) -> float:
    """A judge that gives nothing (the harness may post more for itself)."""
    return 0.0


def gil(inp: dict, output: str) -> float:
    """A judge that holds the GIL for ``inp["hold_s"]`` seconds (libc ``sleep`` called through ``ctypes.PyDLL``,
    which keeps the GIL: as a backtracking regex or a long C loop does), then gives 1.0."""
    import ctypes

    ctypes.PyDLL(None).sleep(int(inp.get("hold_s", 3)))
    return 1.0


def dumpable(inp: dict, output: str) -> float:
    """The worker's own dumpable flag (``prctl(PR_GET_DUMPABLE)``): 1.0 if another process of its user may read
    its memory through ``/proc/<pid>/mem``, 0.0 if not."""
    import ctypes

    return float(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE


def spawns(inp: dict, output: str) -> float:
    """A judge that starts a process (as one that runs model-written code does), writes its pid to
    ``inp["pidfile"]``, then takes ``inp["judge_s"]`` seconds."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(inp["pidfile"], "w") as f:
        f.write(str(child.pid))
    time.sleep(float(inp.get("judge_s", 3600)))
    return 1.0


def judge_runs(inp: dict, output: str) -> float:
    """A code judge (round 23): runs ``inp["code"]`` in a program of its own (``os.system``, as graders run a
    candidate) and scores ``inp["worth"]`` when it exits 0, else 0."""
    import os
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(inp["code"])
    try:
        status = os.system(f"{sys.executable} {f.name} >/dev/null 2>&1")
    finally:
        os.unlink(f.name)
    return float(inp.get("worth", 1.0)) if status == 0 else 0.0


def _passes(code: str) -> None:  # (a module-level target: a spawned or forked process runs it)
    exec(code, {})


def judge_in_process(inp: dict, output: str) -> float:
    """A judge shaped like HumanEval's ``check_correctness``: the candidate in a ``multiprocessing.Process`` with a
    time limit (round 23: refused in a daemonic worker)."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=_passes, args=(inp["code"],))
    proc.start()
    proc.join(60)
    return 1.0 if proc.exitcode == 0 else 0.0


def writes_into_its_pipe(inp: dict, output: str) -> float:
    """What a process forked from the judge (sharing its memory and descriptors) could do: write an answer of its
    own into the worker's pipe to the controller before the judge answers."""
    import gc
    from multiprocessing.connection import Connection

    conn = next(o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed)
    conn.send_bytes(inp["forged"].encode())
    return 0.0
