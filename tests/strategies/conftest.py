"""Launches ``worker.py`` runs (real gloo processes) and caches them for the whole session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 300


def launch(cfg: dict, out: Path, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Runs the worker with Lightning's own launcher (it spawns the other ranks) or under ``torchrun``."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps({**cfg, "out": str(out)}))
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg['devices']}"]
    # A session of its own, so that a hung run takes every rank it spawned down with it.
    proc = subprocess.Popen(
        [*launcher, str(WORKER), str(config)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[test] killed after {LAUNCH_TIMEOUT_S} s"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def load_ranks(out: Path, world_size: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="session")
def run_worker(tmp_path_factory):
    """``run_worker(cfg)`` → per-rank records; each distinct config is launched once per session."""
    cache: dict[str, list[dict]] = {}

    def run(cfg: dict) -> list[dict]:
        key = json.dumps(cfg, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(cfg["strategy"])
            result = launch(cfg, out)
            assert result.returncode == 0, f"{cfg['strategy']} exited {result.returncode}:\n{result.stderr[-6000:]}"
            cache[key] = load_ranks(out, cfg["devices"])
        return cache[key]

    return run
