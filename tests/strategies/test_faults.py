"""Runs of real gloo processes (tests/strategies/fault_worker.py) with a rank frozen by SIGSTOP, or stopped with
SIGTERM: every rank ends, with a status that says the run did not finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_fedshard.distributed.processes import RunProcess
from tests.launching import REPO

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 8
START_DEADLINE_S = 300  # generous: four interpreters importing torch on a loaded CI machine
END_DEADLINE_S = 180  # a frozen rank used to hold the run for torch's 30 minutes


class Run:
    """The worker under Lightning's own launcher (rank 0 starts the others), in a session of its own."""

    def __init__(self, out: Path, strategy: str, devices: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.devices = out, devices
        config = out / "config.json"
        config.write_text(
            json.dumps({"strategy": strategy, "devices": devices, "timeout_s": TIMEOUT_S, "out": str(out)})
        )
        self.stderr = out / "stderr.txt"
        with self.stderr.open("w") as stderr:
            self.launcher = subprocess.Popen(
                [sys.executable, "-m", "tests.strategies.fault_worker", str(config)],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        self.ranks: list[dict] = []

    def wait_for_training(self) -> list[dict]:
        """Every rank's record, written after its first step."""
        deadline = time.monotonic() + START_DEADLINE_S
        files = [self.out / f"rank{r}.json" for r in range(self.devices)]
        while not all(f.exists() for f in files):
            assert self.launcher.poll() is None, f"the run ended before training:\n{self.log()[-6000:]}"
            assert time.monotonic() < deadline, f"no training step after {START_DEADLINE_S} s:\n{self.log()[-6000:]}"
            time.sleep(0.2)
        self.ranks = [json.loads(f.read_text()) for f in files]
        self.processes = [RunProcess.of(r["pid"]) for r in self.ranks]
        return self.ranks

    def wait_until_every_rank_is_gone(self) -> None:
        deadline = time.monotonic() + END_DEADLINE_S
        while self.launcher.poll() is None or any(p.state() not in (None, "Z") for p in self.processes):
            assert time.monotonic() < deadline, (
                f"ranks still there {END_DEADLINE_S} s on: {[p.state() for p in self.processes]}\n{self.log()[-6000:]}"
            )
            time.sleep(0.2)

    def exits(self) -> list[str | None]:
        """How each rank's main ended; ``None`` for a rank killed by a signal."""
        files = [self.out / f"rank{r}.exit" for r in range(self.devices)]
        return [f.read_text() if f.exists() else None for f in files]

    def log(self) -> str:
        return self.stderr.read_text()

    def kill(self) -> None:
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
        for process in getattr(self, "processes", []):
            if process.state() is not None:
                process.kill()
        self.launcher.wait()


@pytest.fixture
def run(tmp_path):
    runs: list[Run] = []

    def start(strategy: str, devices: int) -> Run:
        runs.append(Run(tmp_path / f"run{len(runs)}", strategy, devices))
        return runs[-1]

    yield start
    for started in runs:
        started.kill()


@pytest.mark.parametrize(
    ("strategy", "devices", "frozen", "mesh"),
    [("fl_hsdp", 4, 2, [2, 2, 1]), ("fl_fsdp", 2, 0, [2, 1, 1])],
    ids=["a-launched-rank", "the-launching-rank"],
)
def test_a_frozen_rank_ends_the_whole_run_with_nonzero_statuses(run, strategy, devices, frozen, mesh):
    job = run(strategy, devices)
    ranks = job.wait_for_training()
    # the strategy's timeout reached every group it created, not only the world's
    assert all(r["mesh"] == mesh for r in ranks)
    assert all(r["timeouts_s"] == dict.fromkeys(("fed", "replicate", "shard", "checkpoint"), TIMEOUT_S) for r in ranks)
    os.kill(ranks[frozen]["pid"], signal.SIGSTOP)
    job.wait_until_every_rank_is_gone()
    log = job.log()
    assert job.launcher.returncode != 0, log[-6000:]
    exits = job.exits()
    assert exits[frozen] is None, log[-6000:]  # killed by a peer, never resumed
    assert all(e is not None and e.startswith("raised ") for r, e in enumerate(exits) if r != frozen), exits
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in log
    assert f"killing process {ranks[frozen]['pid']} of the failed run (stopped)" in log


def test_sigterm_stops_every_rank_with_status_143(run):
    job = run("hsdp", 4)
    ranks = job.wait_for_training()
    assert all(r["mesh"] == [1, 2, 2] for r in ranks)  # the name's layout on one node of 4
    job.launcher.send_signal(signal.SIGTERM)  # as a scheduler does; the launcher passes it on to the other ranks
    job.wait_until_every_rank_is_gone()
    log = job.log()
    assert job.launcher.returncode == 143, log[-6000:]
    assert job.exits() == ["exit 143"] * 4, log[-6000:]
    assert "Timed out" not in log and "Traceback" not in log
