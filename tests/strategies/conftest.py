"""Launches ``worker.py`` runs (real gloo processes) and caches them for the whole session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launching import run_isolated

WORKER = Path(__file__).with_name("worker.py")


def launch(cfg: dict, out: Path, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Runs the worker with Lightning's own launcher (it spawns the other ranks) or under ``torchrun``."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps({**cfg, "out": str(out)}))
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg['devices']}"]
    return run_isolated([*launcher, str(WORKER), str(config)])


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
