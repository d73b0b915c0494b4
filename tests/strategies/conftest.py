"""Launches ``worker.py`` runs (real gloo processes) and caches them for the whole session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launching import LAUNCH_TIMEOUT_S, run_isolated

WORKER = Path(__file__).with_name("worker.py")


def launch(cfg: dict, out: Path, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Runs the worker with Lightning's own launcher (it spawns the other ranks) or under ``torchrun``; a minute
    more per fit of a ``runs`` config."""
    for folder in (out, *(Path(run["out"]) for run in cfg.get("runs", []))):
        folder.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps({**cfg, "out": str(out)}))
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg['devices']}"]
    timeout = LAUNCH_TIMEOUT_S + 60 * (len(cfg.get("runs", [cfg])) - 1)
    return run_isolated([*launcher, str(WORKER), str(config)], timeout)


def load_ranks(out: Path, world_size: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


#: Worker configs that may share a launch (see :func:`share_launch`).
_SHAREABLE: list[dict] = []


def share_launch(*cfgs: dict) -> None:
    """Lets ``run_worker`` fit these configs in one launch with any other registered config of as many devices:
    the first of them asked for launches them all (one interpreter start per rank instead of one per config)."""
    _SHAREABLE.extend(cfgs)


def _key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


@pytest.fixture(scope="session")
def run_worker(tmp_path_factory):
    """``run_worker(cfg)`` → per-rank records; each distinct config is fitted once per session, in one launch with
    the not yet fitted :func:`share_launch` configs of the same device count."""
    cache: dict[str, list[dict]] = {}

    def run(cfg: dict) -> list[dict]:
        if _key(cfg) not in cache:
            batch = {_key(cfg): cfg}
            for other in _SHAREABLE:
                if other["devices"] == cfg["devices"] and _key(other) not in cache:
                    batch.setdefault(_key(other), other)
            outs = {key: tmp_path_factory.mktemp(c["strategy"]) for key, c in batch.items()}
            runs = [{**c, "out": str(outs[key])} for key, c in batch.items()]
            launch_dir = tmp_path_factory.mktemp("launch")
            result = launch({"devices": cfg["devices"], "runs": runs}, launch_dir)
            names = ", ".join(c["strategy"] for c in batch.values())
            assert result.returncode == 0, f"{names} exited {result.returncode}:\n{result.stderr[-6000:]}"
            for key, c in batch.items():
                cache[key] = load_ranks(outs[key], c["devices"])
        return cache[_key(cfg)]

    return run
