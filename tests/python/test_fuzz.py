"""Runs the fuzzers of fuzz_cases.py in a child process per device: a crash there fails this test
instead of the whole run. SNACK_FUZZ_EXAMPLES sets the examples per target (default 120)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASE_FILE = Path(__file__).with_name("fuzz_cases.py")


def test_fuzzers(device):
    pytest.importorskip("hypothesis", reason="the fuzzers need hypothesis (pip install hypothesis)")
    env = dict(os.environ, SNACK_FUZZ_DEVICE=device.type)
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                            "ignore::DeprecationWarning", str(CASE_FILE)], capture_output=True, text=True,
                           timeout=1800, env=env, cwd=CASE_FILE.parents[2])
    assert child.returncode == 0, f"fuzzers on {device.type} exited with {child.returncode}\n{child.stdout[-8000:]}\n" \
                                  f"{child.stderr[-4000:]}"
