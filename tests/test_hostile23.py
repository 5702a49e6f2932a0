"""Round 23 of hostile input (docs/operations.md, "A twenty-third round"): each test failed before its fix."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
