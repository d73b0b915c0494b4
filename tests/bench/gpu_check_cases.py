"""Checks for tests/bench/test_gpu_check.py: what a GPU check can do to the runner (pass, fail, crash, hang), run as
``python -m lightning_fedshard.bench.gpu_check --child tests.bench.gpu_check_cases:NAME``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def passes(figure: str = "42 GB/s") -> dict:
    return {"status": "pass", "figure": figure, "details": [{"n": 1, "GB/s": 42.0}]}


def raises() -> dict:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def crashes() -> dict:
    os._exit(3)  # as a segfaulting kernel would: no result written


def hangs(pid_file: str) -> dict:
    """Starts a grandchild, records its pid, then hangs (the runner must kill both)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(300)
    return passes()
