"""Round 23 of hostile input (docs/operations.md, "A twenty-third round"): each test failed before its fix."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_verl_entry_point_makes_its_log_records_printable():
    """(Left open by round 22's nineteenth prober.) ``train --backend verl`` runs its lease in ``python -m
    agl_trainer.backends.verl.main``, which did not install the printable log records: its lease warnings would print
    a hostile Redis's terminal escapes raw. It installs them first, as the three CLIs do."""
    code = ("import logging\n"
            "from agl_trainer.backends.verl.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "record = logging.getLogger('agl.lease').makeRecord('agl.lease', 30, 'x', 1, 'lost: %s', ('\\x1b]8;;x\\x07',), None)\n"
            "print(repr(record.getMessage()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert "\\\\x1b" in last, last  # (repr: an escaped ESC shows two backslashes, a raw one one)


async def test_what_a_judge_runs_cannot_reach_the_controller_or_forge_a_reward(monkeypatch, tmp_path):
    """(The twenty-first prober's first finding.) The reward worker's descriptors were inheritable (spawn passes them
    so) and the controller unpickled whatever came through its pipe: a candidate program a judge ran with
    ``os.system`` wrote one framed pickle into the inherited socket and ran code in the controller (the admin key
    read from its memory), its forged reward 123456 was recorded, and the worker's real answer was read as the next
    call's. Now what crosses the pipe is JSON under a nonce per request, checked again in the controller; the
    worker's descriptors are closed on exec; a worker whose pipe holds more than its answer is not kept."""
    from agl_controller.reward import RewardFunctionError, RewardPool

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "harnesses"))
    proof = tmp_path / "ran-in-controller"
    payload = (
        "import os, pickle, struct\n"
        "class P:\n"
        "    def __reduce__(self):\n"
        f"        return (eval, (\"(open({str(proof)!r}, 'w').write('x'), (True, 123456.0))[1]\",))\n"
        "data = pickle.dumps(P())\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        if os.readlink(f'/proc/self/fd/{fd}').startswith(('socket:', 'pipe:')):\n"
        "            os.write(int(fd), struct.pack('!i', len(data)) + data)\n"
        "            os.write(int(fd), struct.pack('!i', 22) + b'[\"0\", true, 123456.0]')\n"
        "    except OSError:\n"
        "        pass\n")
    pool = RewardPool("rewards:judge_runs", idle=1)
    try:
        assert await pool.score({"code": payload, "worth": 1.0}, "", 60) == 1.0
        assert await pool.score({"code": "raise SystemExit(1)"}, "", 60) == 0.0
        assert await pool.score({"code": "pass", "worth": 0.25}, "", 60) == 0.25
        assert not proof.exists()
    finally:
        pool.close()

    pool = RewardPool("rewards:writes_into_its_pipe", idle=1)
    try:
        for forged in ("x", '["0", true, 5.0]', '[null, true, 5.0]', '[]', '{"a": 1}', "[1e999]"):
            with pytest.raises(RewardFunctionError, match="out of turn"):
                await pool.score({"forged": forged}, "", 60)
            assert pool._idle == []  # (a worker that answered out of turn is never kept)
        with pytest.raises(RewardFunctionError, match="more than 4096 bytes"):
            await pool.score({"forged": "[" + " " * 5000 + "]"}, "", 60)
    finally:
        pool.close()


async def test_a_judge_may_start_processes_of_its_own(monkeypatch):
    """(The twenty-first prober's second finding.) The worker was a daemonic process, and multiprocessing refuses
    children to those: a judge shaped like HumanEval's ``check_correctness`` (the candidate in a
    ``multiprocessing.Process`` with a time limit), a ``Pool``, verl's ``prime_code`` failed every run with
    ``reward_error``. An input holding an integer beyond 64 bits still reaches the judge."""
    from agl_controller.reward import RewardPool

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "harnesses"))
    pool = RewardPool("rewards:judge_in_process", idle=1)
    try:
        assert await pool.score({"code": "assert 1 + 1 == 2", "big": 10**30}, "", 120) == 1.0
        assert await pool.score({"code": "assert 1 + 1 == 3"}, "", 120) == 0.0
    finally:
        pool.close()
