"""Test files whose kernels run under Triton's interpreter on the CPU (`TRITON_INTERPRET=1`).

Triton reads TRITON_INTERPRET when it is first imported (its own `tl` helpers are built then), and other test
modules import it earlier through compressed-tensors; so unless this process already interprets, a driver test
runs the file again in a fresh process with the flag set (`run_in_interpreter`), and the file's other tests
(`needs_interpreter`) run only there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
driver = pytest.mark.skipif(INTERPRETING, reason="this is the driver")


def run_in_interpreter(path: str, expect: str, timeout: float = 900) -> None:
    """Run the test file `path` under the interpreter (one OpenMP thread, HYBRID_BACKEND as the file sets it)
    and assert it passed with the summary `expect` (e.g. "6 passed, 1 skipped": every test ran)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("HYBRID_BACKEND", None)
    r = subprocess.run([sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", "-p", "no:warnings"],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and expect in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
