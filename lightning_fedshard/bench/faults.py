"""A federation that loses a group and gets it back: ``fedshard bench faults [--quick]``.

Two federation groups of the tiny FL+FSDP recipe (``tiny/fl_fsdp``, 2 ranks each, DiLoCo), each its
own ``fedshard fit`` job with ``fault_tolerance``, and one torchft Lighthouse in this process. Two runs:

* **uninterrupted**: both groups train to the same federation step;
* **fault**: at step ``--kill-at`` one rank of group 1 is killed with SIGKILL (its job fails), group 1 stays down
  for ``--down-s`` seconds, is restarted with the same command, heals from group 0 and trains to the end.

It reports group 0's tokens/s with both groups up (uninterrupted run) and while group 1 is down (from the kill
until group 1 has rejoined), the time from the restart to the rejoined group's first step (its interpreters
starting, the joining round, the transfer of the state from group 0), and group 0's last validation loss in both
runs. Everything comes from a probe callback's per-step records with wall-clock times. The groups share this
machine's cores: a group alone runs faster than two side by side, so the figures are indicative only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl

from lightning_fedshard.bench.recipes import TINY
from lightning_fedshard.compat import require_extra

__all__ = ["FaultProbe", "FaultRun", "format_table", "main"]

RECIPE = TINY / "fl_fsdp.yaml"
PROBE_ENV, STOP_ENV, HOLD_ENV = "FEDSHARD_FAULTS_PROBE", "FEDSHARD_FAULTS_STOP_AT", "FEDSHARD_FAULTS_HOLD"
HEARTBEAT_TIMEOUT_MS = 2000
WAIT_S = 900


class FaultProbe(pl.Callback):
    """Appends one JSON line per event to the file named by ``$FEDSHARD_FAULTS_PROBE`` (rank 0 of a group only):
    ``start`` (after the joining round), ``step`` (wall time, the strategy's optimizer steps, tokens of the group,
    groups in the last round), ``val``; stops the fit once the optimizer steps reach ``$FEDSHARD_FAULTS_STOP_AT``.
    ``joining`` comes before the joining round. While the file ``$FEDSHARD_FAULTS_HOLD`` exists, the group holds
    (``hold`` / ``resume``) 16 steps before its end, so that it does not finish before a restarted peer is back.
    """

    def __init__(self) -> None:
        self.path = Path(os.environ[PROBE_ENV])
        self.stop_at = int(os.environ[STOP_ENV])
        self.hold = Path(os.environ[HOLD_ENV]) if os.environ.get(HOLD_ENV) else None

    def _write(self, trainer: pl.Trainer, event: str, **fields: float) -> None:
        if trainer.global_rank == 0:
            strategy = trainer.strategy
            member = getattr(strategy, "_member", None)
            record = {
                "event": event,
                "t": time.time(),
                "pid": os.getpid(),
                "steps": strategy.optimizer_steps,
                "groups": member.last_participants if member else 0,
                **fields,
            }
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:  # callbacks run before the strategy's joining round
        self._write(trainer, "joining")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self._write(trainer, "start")
            self._hold_while(trainer, self.hold and self.hold.with_name("hold_start"))  # until the peer starts
        if trainer.strategy.optimizer_steps >= self.stop_at - 16:
            self._hold_while(trainer, self.hold)

    def _hold_while(self, trainer: pl.Trainer, path: Path | None) -> None:
        if path is None or not path.exists():
            return
        self._write(trainer, "hold")
        deadline = time.monotonic() + WAIT_S
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._write(trainer, "resume")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._write(trainer, "step", tokens=float(batch[0].numel() * trainer.world_size))
        if trainer.strategy.optimizer_steps >= self.stop_at:
            trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if "val_loss" in trainer.callback_metrics:
            self._write(trainer, "val", val_loss=float(trainer.callback_metrics["val_loss"]))


@dataclass
class FaultRun:
    name: str
    steps: int
    tokens_per_s_both_up: float
    """Group 0 with both groups in its rounds (before any kill), its longest stretch of consecutive steps."""
    tokens_per_s_alone: float
    """Group 0 from the kill until group 1's first step after rejoining (or group 0's hold before its end)."""
    restart_to_rejoined_s: float
    """From starting group 1's new job to its first step after the joining round; NaN without a fault."""
    rounds_alone: int
    """Group 0's steps logged with one group in its last round while group 1 was down."""
    val_loss: float
    """Group 0's last validation loss."""


class Federation:
    """A Lighthouse and one ``fedshard fit`` job per group, each in a session of its own."""

    def __init__(self, out: Path, steps: int, overrides: list[str]) -> None:
        require_extra("torchft", "ft", "The fault-tolerance benchmark")
        from torchft.coordination import LighthouseServer

        self.out, self.steps, self.overrides = out, steps, overrides
        out.mkdir(parents=True, exist_ok=True)
        self.lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=1,
            join_timeout_ms=1000,
            quorum_tick_ms=50,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
        self.jobs: dict[int, list[subprocess.Popen]] = {0: [], 1: []}

    def probe(self, group: int) -> Path:
        return self.out / f"group{group}.jsonl"

    def records(self, group: int, event: str | None = None) -> list[dict]:
        path = self.probe(group)
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines if line.strip()]
        return [r for r in records if event is None or r["event"] == event]

    def start(self, group: int, hold: bool = False) -> subprocess.Popen:
        env = {
            **({HOLD_ENV: str(self.out / "hold")} if hold else {}),
            **os.environ,
            "TORCHFT_LIGHTHOUSE": self.lighthouse.address(),
            "REPLICA_GROUP_ID": str(group),
            "NUM_REPLICA_GROUPS": "2",  # each group reads its own half of the data
            PROBE_ENV: str(self.probe(group)),
            STOP_ENV: str(self.steps),
        }
        launch = len(self.jobs[group])
        command = [
            sys.executable, "-m", "lightning_fedshard.cli", "fit", "--config", str(RECIPE),
            "--trainer.devices=2",
            "--trainer.strategy.init_args.num_groups=null",
            "--trainer.strategy.init_args.outer_optimizer=nesterov",
            '--trainer.strategy.init_args.fault_tolerance={"timeout": "0:00:30", "quorum_timeout": "0:15:00"}',
            f"--trainer.max_steps={self.steps}",  # the job's own steps: a restarted job is stopped by the probe
            "--trainer.callbacks+=lightning_fedshard.bench.faults.FaultProbe",
            f"--trainer.logger.init_args.save_dir={self.out / f'group{group}_launch{launch}'}",
            "--trainer.enable_checkpointing=false",
            *self.overrides,
        ]  # fmt: skip
        log = (self.out / f"group{group}_launch{launch}.log").open("w")
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.jobs[group].append(job)
        return job

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            failed = [g for g, jobs in self.jobs.items() if jobs and jobs[-1].poll() not in (None, 0)]
            if failed and not getattr(self, "expect_failure", False):
                raise RuntimeError(f"{what}: group {failed[0]} failed; see {self.out}/group{failed[0]}_launch*.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {WAIT_S} s; see the logs in {self.out}")
            time.sleep(0.2)

    def finish(self) -> None:
        for group, jobs in self.jobs.items():
            code = jobs[-1].wait(timeout=WAIT_S)
            if code != 0:
                raise RuntimeError(f"group {group} exited {code}; see {self.out}/group{group}_launch*.log")

    def close(self) -> None:
        for jobs in self.jobs.values():
            for job in jobs:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        self.lighthouse.shutdown()


def _rank1_pid(federation: Federation, group_job: subprocess.Popen) -> int:
    """The pid of the job's rank 1: the child Lightning's launcher (rank 0) spawned."""
    children = Path(f"/proc/{group_job.pid}/task/{group_job.pid}/children").read_text().split()
    pids = [int(pid) for pid in children if "lightning_fedshard.cli" in _cmdline(int(pid))]
    if not pids:
        raise RuntimeError(f"group 1's job {group_job.pid} has no rank-1 process to kill")
    return pids[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _runs(steps: list[dict]) -> list[list[dict]]:
    """``steps`` split where the optimizer steps are not consecutive."""
    runs: list[list[dict]] = []
    for r in steps:
        if runs and r["steps"] == runs[-1][-1]["steps"] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def _rate(steps: list[dict]) -> float:
    """Tokens per second over consecutive step records (the first one only starts the clock)."""
    if len(steps) < 2:
        return math.nan
    return sum(r["tokens"] for r in steps[1:]) / (steps[-1]["t"] - steps[0]["t"])


def run(name: str, out: Path, steps: int, kill_at: int | None, down_s: float, overrides: list[str]) -> FaultRun:
    federation = Federation(out / name, steps, overrides)
    try:
        if kill_at is not None:
            (federation.out / "hold").touch()  # group 0 may not finish before group 1 is back
        (federation.out / "hold_start").touch()  # nor train alone while group 1's interpreters start
        # group 0 first, so that its own steps are the federation's (and its validations)
        federation.start(0, hold=True)
        federation.wait_for(lambda: federation.records(0, "start"), "group 0 starts")
        federation.start(1)
        federation.wait_for(lambda: federation.records(1, "joining"), "group 1 starts")
        (federation.out / "hold_start").unlink()
        restart_t = kill_t = math.nan
        if kill_at is not None:
            federation.wait_for(
                lambda: any(r["steps"] >= kill_at for r in federation.records(1, "step")), "group 1 reaches the kill"
            )
            victim = _rank1_pid(federation, federation.jobs[1][-1])
            federation.expect_failure = True
            kill_t = time.time()
            os.kill(victim, signal.SIGKILL)
            federation.jobs[1][-1].wait(timeout=WAIT_S)
            time.sleep(max(0.0, down_s - (time.time() - kill_t)))
            federation.expect_failure = False
            restart_t = time.time()
            job = federation.start(1)
            federation.wait_for(
                lambda: any(r["pid"] == job.pid for r in federation.records(1, "joining")), "group 1 restarts"
            )
            (federation.out / "hold").unlink()
            federation.wait_for(
                lambda: any(r["pid"] == job.pid for r in federation.records(1, "step")), "group 1 rejoins"
            )
            first = next(r for r in federation.records(1, "step") if r["pid"] == job.pid)
            if first["groups"] < 2:
                raise RuntimeError(
                    f"group 0 finished its {steps} steps before the restarted group 1 joined it (its first round had"
                    f" {first['groups']} group): run longer (--steps) or kill earlier (--kill-at)."
                )
        federation.finish()
    finally:
        federation.close()
    g0_steps = federation.records(0, "step")
    val = federation.records(0, "val")
    together = [r for r in g0_steps if r["groups"] == 2 and not r["t"] >= kill_t]
    both_up = max(_runs(together), key=len, default=[])  # the longest stretch of consecutive steps
    if kill_at is None:
        alone, rejoined = [], math.nan
    else:
        rejoined = min(r["t"] for r in federation.records(1, "step") if r["t"] > restart_t)
        held = [r["t"] for r in federation.records(0, "hold") if r["t"] > kill_t]
        alone = [r for r in g0_steps if kill_t <= r["t"] <= min([rejoined, *held])]
    return FaultRun(
        name=name,
        steps=steps,
        tokens_per_s_both_up=_rate(both_up),
        tokens_per_s_alone=_rate(alone) if alone else math.nan,
        restart_to_rejoined_s=rejoined - restart_t,
        rounds_alone=sum(r["groups"] == 1 for r in alone),
        val_loss=val[-1]["val_loss"] if val else math.nan,
    )


def format_table(runs: list[FaultRun]) -> str:
    base = runs[0]
    lines = [
        "group 0's tokens/s (its 2 ranks); 'alone': from the kill of a group-1 rank until group 1 trains again",
        f"{'run':<14} {'steps':>5} {'tok/s both up':>13} {'tok/s alone':>11} {'alone/base':>10}"
        f" {'restart→rejoined s':>18} {'val loss':>8} {'vs base':>8}",
    ]
    for r in runs:
        lines.append(
            f"{r.name:<14} {r.steps:>5} {r.tokens_per_s_both_up:>13.0f} {r.tokens_per_s_alone:>11.0f}"
            f" {r.tokens_per_s_alone / base.tokens_per_s_both_up:>10.2f} {r.restart_to_rejoined_s:>18.1f}"
            f" {r.val_loss:>8.4f} {r.val_loss / base.val_loss:>8.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="96 steps, kill at 8, restarted at once")
    parser.add_argument("--steps", type=int, default=160, help="federation steps of each run (a multiple of 16)")
    parser.add_argument("--kill-at", type=int, default=16, help="group 1's step at which one of its ranks is killed")
    parser.add_argument("--down-s", type=float, default=10.0, help="seconds group 1 stays down")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-faults"))
    args, overrides = parser.parse_known_args(argv)
    if args.quick:
        args.steps, args.kill_at, args.down_s = 96, 8, 0.0
    runs = [
        run("uninterrupted", args.out, args.steps, None, 0.0, overrides),
        run("fault", args.out, args.steps, args.kill_at, args.down_s, overrides),
    ]
    table = format_table(runs)
    print(table)
    (args.out / "faults.json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
    (args.out / "faults.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
