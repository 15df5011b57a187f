"""ruff over the product code, with its ASYNC rules: a blocking call in async code, an
unused name or a lost exception fails the suite."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "bluecached", "hostd", "fusefs",
                        "native"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
