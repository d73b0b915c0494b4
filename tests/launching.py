"""Runs a command that spawns several processes, in a session of its own so that a hung run is killed whole."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 300


def run_isolated(command: list[str], timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[test] killed after {timeout} s"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
