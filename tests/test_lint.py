"""The code base stays lint-clean (ruff, configured in pyproject.toml; installed by the test extra)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
