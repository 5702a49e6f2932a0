"""Ctrl-C / SIGTERM during an update (issue 25): the CPU backend stops within a micro-batch, and a process whose
update runs in a worker thread exits at once (agl_trainer.interrupt)."""

from __future__ import annotations

import pytest
import torch

from test_ppo_minibatch import backend, make_rows, tiny_model  # noqa: F401 - the fixture


def test_a_stop_request_ends_an_update_before_its_optimizer_step(tiny_model, tmp_path):  # noqa: F811
    from agl_trainer import interrupt

    rows, adv = make_rows()
    b = backend(tiny_model, tmp_path)
    before = {n: p.detach().clone() for n, p in b.model.named_parameters() if p.requires_grad}
    interrupt.requested.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            b.update(rows, adv)
    finally:
        interrupt.requested.clear()
    assert b.steps == 0
    assert all(torch.equal(p, before[n]) for n, p in b.model.named_parameters() if p.requires_grad)


def test_sigterm_stops_a_process_whose_update_runs_in_a_worker_thread(tmp_path):
    """The run's shape: asyncio.run awaiting work on the torch thread (agl_trainer.compute). Without the shared
    stop request the process would only exit when the worker's 120 s of work ended (the interpreter joins
    executor threads at exit)."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "worker.py"
    script.write_text(
        "import asyncio, time\n"
        "from agl_trainer import compute, interrupt\n"
        "def work():\n"
        "    end = time.monotonic() + 120\n"
        "    while time.monotonic() < end:\n"
        "        interrupt.check()\n"
        "        time.sleep(0.05)\n"
        "interrupt.install()\n"
        "print('ready', flush=True)\n"
        "try:\n"
        "    asyncio.run(compute.run(work))\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert "interrupted" in out and time.monotonic() - t0 < 10
