"""Runs the bad-input matrix of bad_inputs.py on every device: each case in this process, or, where
it hands raw memory to a kernel, in a child process (a crash there is a failed test)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bad_inputs import CASES, run_in_this_process

CASE_FILE = Path(__file__).with_name("bad_inputs.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, device):
    spec = CASES[name]
    if spec.gpu_only and device.type != "cuda":
        pytest.skip("a case of mixed devices: needs a GPU layer")
    if not spec.isolated:
        run_in_this_process(name, device.type)
        return
    child = subprocess.run([sys.executable, str(CASE_FILE), name, device.type], capture_output=True, text=True,
                           timeout=600, env=dict(os.environ))
    assert child.returncode == 0, (f"case {name} on {device.type} exited with {child.returncode}\n"
                                   f"{child.stdout[-3000:]}\n{child.stderr[-6000:]}")
