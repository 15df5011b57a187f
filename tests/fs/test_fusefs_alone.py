"""fusefs defines the interfaces it needs (Cache, SlotWriter, Transfers) and hostd implements
them: fusefs itself loads neither hostd nor bluecached."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fusefs_loads_neither_hostd_nor_bluecached():
    probe = ("import sys, fusefs, fusefs.errors, fusefs.inplace, fusefs.ioctl\n"
             "print(' '.join(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('hostd', 'bluecached'))))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == ""
