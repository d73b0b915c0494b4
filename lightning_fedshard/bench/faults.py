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
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_fedshard.bench.recipes import TINY
from lightning_fedshard.compat import require_extra
from lightning_fedshard.distributed import SHARE_STORE_SWITCH

__all__ = ["FaultProbe", "FaultRun", "format_table", "main"]

RECIPE = TINY / "fl_fsdp.yaml"
PROBE_ENV, STOP_ENV, HOLD_ENV = "FEDSHARD_FAULTS_PROBE", "FEDSHARD_FAULTS_STOP_AT", "FEDSHARD_FAULTS_HOLD"
HEARTBEAT_TIMEOUT_MS = 2000
WAIT_S = 900
END_WAIT_S = 30  # for a job told to stop


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
        member = getattr(trainer.strategy, "_member", None)
        if member is not None:
            member.track_memory = True  # peak resident memory of every round, the joining one included
            self._write_rank(trainer, {"event": "state", "bytes": member.state_bytes()})

    def _write_rank(self, trainer: pl.Trainer, record: dict) -> None:
        """Every rank's own records (``group<g>.rank<r>.jsonl``): its state size and its rounds."""
        with self.path.with_suffix(f".rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps({**record, "t": time.time(), "pid": os.getpid()}) + "\n")

    def _write_rounds(self, trainer: pl.Trainer) -> None:
        member = getattr(trainer.strategy, "_member", None)
        while member is not None and member.rounds_log and "end" in member.rounds_log[0]:
            self._write_rank(trainer, {"event": "round", **member.rounds_log.popleft()})

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
        self._write_rounds(trainer)
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


#: How a failed group comes back: ``launch``: ``fedshard launch`` restarts its ranks in place, forked from an
#: interpreter that has imported torch, Lightning and torchft; ``torchrun``: torchrun restarts them in place as new
#: interpreters (both ``--max-restarts``: the agent stays); ``job``: the job fails as a whole and the same
#: ``fedshard fit`` command is started again (Lightning's launcher spawns rank 1 from rank 0).
RESTARTS = ("launch", "torchrun", "job")


class Federation:
    """A Lighthouse and one ``fedshard fit`` job per group, each in a session of its own: under ``fedshard launch``
    or ``torchrun`` with ``--max-restarts=1``, or under Lightning's own launcher (``restart``, one of
    :data:`RESTARTS`)."""

    def __init__(
        self, out: Path, steps: int, overrides: list[str], heal_transport: str = "stream", restart: str = "job"
    ) -> None:
        require_extra("torchft", "ft", "The fault-tolerance benchmark")
        from torchft.coordination import LighthouseServer

        self.out, self.steps, self.overrides, self.heal_transport = out, steps, overrides, heal_transport
        self.restart = restart
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

    def records(self, group: int, event: str | None = None, rank: int | None = None) -> list[dict]:
        path = self.probe(group) if rank is None else self.probe(group).with_suffix(f".rank{rank}.jsonl")
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
            SHARE_STORE_SWITCH: "1",  # each torchrun restart gets a store of its own
        }
        launch = len(self.jobs[group])
        agent = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
        launcher = {
            "launch": ["-m", "lightning_fedshard.cli", "launch", *agent],
            "torchrun": ["-m", "torch.distributed.run", *agent, "-m", "lightning_fedshard.cli"],
            "job": ["-m", "lightning_fedshard.cli"],
        }[self.restart]
        command = [
            sys.executable, *launcher, "fit", "--config", str(RECIPE),
            "--trainer.devices=2",
            "--trainer.strategy.init_args.num_groups=null",
            "--trainer.strategy.init_args.outer_optimizer=nesterov",
            "--trainer.strategy.init_args.fault_tolerance="
            + json.dumps({"timeout": "0:00:30", "quorum_timeout": "0:15:00", "heal_transport": self.heal_transport}),
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
                    # torchrun's workers are in sessions of their own: its agent ends them on SIGTERM
                    os.killpg(job.pid, signal.SIGTERM)
                    try:
                        job.wait(timeout=END_WAIT_S)
                    except subprocess.TimeoutExpired:
                        os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        self.lighthouse.shutdown()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


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


@dataclass
class Timeline:
    """The bench's own wall-clock times of one run (NaN without a fault)."""

    kill: float = math.nan
    dead: float = math.nan
    """Group 1's failed job has exited: from here it can be restarted."""
    restart: float = math.nan
    pid: int = 0
    """Group 1's restarted rank 0."""


def _play(federation: Federation, steps: int, kill_at: int | None, down_s: float) -> Timeline:
    """Runs the federation to its end, killing one rank of group 1 at ``kill_at`` and restarting the group."""
    timeline = Timeline()
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
        if kill_at is not None:
            federation.wait_for(
                lambda: any(r["steps"] >= kill_at for r in federation.records(1, "step")), "group 1 reaches the kill"
            )
            victim = federation.records(1, "state", rank=1)[-1]["pid"]
            survivor = federation.records(1, "joining")[-1]["pid"]
            federation.expect_failure = federation.restart == "job"
            timeline.kill = time.time()
            os.kill(victim, signal.SIGKILL)
            if federation.restart == "job":
                federation.jobs[1][-1].wait(timeout=WAIT_S)
            else:  # the agent saw the rank die, stopped the other and starts both again on its own
                federation.wait_for(lambda: not _alive(survivor), "group 1's other rank is stopped")
            timeline.dead = time.time()
            time.sleep(max(0.0, down_s - (time.time() - timeline.kill)))
            federation.expect_failure = False
            timeline.restart = time.time()
            if federation.restart == "job":
                federation.start(1)
            federation.wait_for(
                lambda: any(r["pid"] != survivor for r in federation.records(1, "joining")), "group 1 restarts"
            )
            timeline.pid = next(r["pid"] for r in federation.records(1, "joining") if r["pid"] != survivor)
            (federation.out / "hold").unlink()
            federation.wait_for(
                lambda: any(r["pid"] == timeline.pid for r in federation.records(1, "step")), "group 1 rejoins"
            )
            first = next(r for r in federation.records(1, "step") if r["pid"] == timeline.pid)
            if first["groups"] < 2:
                raise RuntimeError(
                    f"group 0 finished its {steps} steps before the restarted group 1 joined it (its first round had"
                    f" {first['groups']} group): run longer (--steps) or kill earlier (--kill-at)."
                )
        federation.finish()
    finally:
        federation.close()
    (federation.out / "timeline.json").write_text(json.dumps(asdict(timeline)))
    return timeline


def run(name: str, out: Path, steps: int, kill_at: int | None, down_s: float, overrides: list[str]) -> FaultRun:
    federation = Federation(out / name, steps, overrides)
    timeline = _play(federation, steps, kill_at, down_s)
    kill_t, restart_t = timeline.kill, timeline.restart
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


# ---- heal time against state size (--state-mb) -----------------------------------------------------------------

#: Bytes per parameter a heal moves: the fp32 parameter, DiLoCo's fp32 global copy and its fp32 outer momentum.
HEAL_BYTES_PER_PARAM = 12
HEAL_STEPS, HEAL_KILL_AT, HEAL_SYNC_EVERY = 24, 4, 4


def llama_overrides(state_mb: float) -> dict[str, int]:
    """A Llama 3 shape (byte vocabulary, 64-wide heads, GQA with 4 or 2 queries per key, SwiGLU 3.5 × dim, about
    dim / 128 layers) whose
    state a heal moves, :data:`HEAL_BYTES_PER_PARAM` bytes per parameter, is closest to ``state_mb`` MiB."""
    from lightning_fedshard.models.config import LlamaConfig

    tiny = LlamaConfig.from_name("llama3.1-tiny")
    best: tuple[float, dict[str, int]] | None = None
    for dim in range(128, 4097, 128):
        heads = dim // 64
        shape = {
            "dim": dim,
            "n_heads": heads,
            "n_kv_heads": heads // 4 if heads % 4 == 0 else heads // 2,
            "ffn_dim": round(3.5 * dim / 64) * 64,
        }
        for layers in range(max(2, dim // 128 - 2), dim // 128 + 3):  # Llama 3's depth: about dim / 128 layers
            params = _llama_params(tiny.vocab_size, layers=layers, **shape)
            error = abs(math.log(params * HEAL_BYTES_PER_PARAM / (state_mb * 2**20)))
            if best is None or error < best[0]:
                best = (error, {**shape, "n_layers": layers})
    assert best is not None
    return best[1]


def _llama_params(vocab: int, dim: int, layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> int:
    kv = dim // n_heads * n_kv_heads
    block = 2 * dim * dim + 2 * dim * kv + 3 * dim * ffn_dim + 2 * dim  # q, o; k, v; SwiGLU; two norms
    return layers * block + 2 * vocab * dim + dim  # embedding, output, final norm


def _link_worker(rank: int, port: int, nbytes: int, repeats: int, result: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.ones(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(tensor, 1 - rank)
        seconds.append(time.perf_counter() - start)
    if rank == 1:
        result.put(sorted(seconds)[len(seconds) // 2])
    dist.destroy_process_group()


def link_bytes_per_s(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """The link between two processes of this machine: one gloo send/recv of ``nbytes``, the median of ``repeats``."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    result = context.SimpleQueue()
    mp.start_processes(_link_worker, args=(port, nbytes, repeats, result), nprocs=2, start_method="spawn")
    return nbytes / result.get()


@dataclass
class HealRun:
    state_mb: float
    """Requested state per group, MiB."""
    transport: str
    restart: str
    """How group 1 came back: one of :data:`RESTARTS`."""
    shape: str
    state_bytes: int
    """What the heal moved: group 1's ranks' shards of the parameters and outer state, summed."""
    detection_s: float
    """The kill until group 1's other rank is gone: its launcher (torchrun's agent, or Lightning's in rank 0) saw
    the rank die and ended the others (for ``job``, the job has exited)."""
    restart_s: float
    """From there until the new ranks' first quorum request (interpreters, model, Manager)."""
    quorum_s: float
    """Until the quorum that heals it is granted and the transfer starts (group 0 reaching its next round)."""
    transfer_s: float
    """The first rank's receive starting until the last rank's has finished."""
    resume_s: float
    """The end of the transfer until the healed group's first step has ended."""
    total_s: float
    """The kill until the healed group's first step has ended."""
    recv_extra_mb: float
    """Peak resident memory during the quorum that heals group 1 above the memory before it, worst rank, MiB."""
    send_extra_mb: float
    """The same for group 0's ranks in the round they sent in, less their median of the rounds without a heal."""
    shard_mb: float
    """One rank's share of the state, MiB."""


def heal_run(out: Path, state_mb: float, transport: str, overrides: list[str], restart: str = "torchrun") -> HealRun:
    shape = llama_overrides(state_mb)
    settings = [
        f"--model.overrides={json.dumps(shape)}",
        "--data.seq_len=32",
        "--data.batch_size=1",
        f"--trainer.strategy.init_args.sync_every={HEAL_SYNC_EVERY}",
        "--trainer.limit_val_batches=0",
    ]
    name = f"heal-{state_mb:g}mb-{transport}-{restart}"
    federation = Federation(out / name, HEAL_STEPS, [*settings, *overrides], transport, restart)
    timeline = _play(federation, HEAL_STEPS, HEAL_KILL_AT, 0.0)

    heal_rounds, states = [], []
    for rank in (0, 1):
        restarted = [r for r in federation.records(1, None, rank) if r["t"] > timeline.restart]  # the new job's
        heal_rounds.append(
            next(r for r in restarted if r["event"] == "round" and any(t["role"] == "recv" for t in r["transfers"]))
        )
        states.append(next(r["bytes"] for r in restarted if r["event"] == "state"))
    recvs = [next(t for t in r["transfers"] if t["role"] == "recv") for r in heal_rounds]
    first_step = min(r["t"] for r in federation.records(1, "step") if r["pid"] == timeline.pid)
    send_extra = []
    for rank in (0, 1):
        rounds = federation.records(0, "round", rank)
        sent = [r for r in rounds if any(t["role"] == "send" for t in r["transfers"])]
        normal = sorted(r["peak_kb"] - r["rss_kb"] for r in rounds if not r["transfers"])
        send_extra += [r["peak_kb"] - r["rss_kb"] - (normal[len(normal) // 2] if normal else 0) for r in sent]
    quorum_start = min(r["quorum_start"] for r in heal_rounds)
    return HealRun(
        state_mb=state_mb,
        transport=transport,
        restart=restart,
        shape=f"d{shape['dim']}×{shape['n_layers']}",
        state_bytes=sum(states),
        detection_s=timeline.dead - timeline.kill,
        restart_s=quorum_start - timeline.restart,
        quorum_s=min(t["start"] for t in recvs) - quorum_start,
        transfer_s=max(t["end"] for t in recvs) - min(t["start"] for t in recvs),
        resume_s=first_step - max(t["end"] for t in recvs),
        total_s=first_step - timeline.kill,
        recv_extra_mb=max(r["quorum_peak_kb"] - r["rss_kb"] for r in heal_rounds) / 1024,
        send_extra_mb=max(send_extra, default=math.nan) / 1024,
        shard_mb=max(states) / 2**20,
    )


def format_heal_table(runs: list[HealRun], link: float) -> str:
    lines = [
        f"heal of a restarted group (2 ranks) from a live one; link (gloo send/recv, 2 processes): {link / 1e9:.2f}"
        " GB/s; target: 10 s + state / link",
        f"{'state':>7} {'shape':>9} {'transport':>9} {'restart by':>10} {'detect':>6} {'restart':>7} {'quorum':>6} {'transfer':>8}"
        f" {'resume':>6} {'total':>6} {'target':>6} {'GB/s':>5} {'recv +MB':>8} {'send +MB':>8} {'shard MB':>8}",
    ]
    for r in runs:
        lines.append(
            f"{r.state_bytes / 2**20:>5.0f}MB {r.shape:>9} {r.transport:>9} {r.restart:>10} {r.detection_s:>6.1f} {r.restart_s:>7.1f}"
            f" {r.quorum_s:>6.1f} {r.transfer_s:>8.2f} {r.resume_s:>6.1f} {r.total_s:>6.1f}"
            f" {10 + r.state_bytes / link:>6.1f} {r.state_bytes / r.transfer_s / 1e9:>5.2f} {r.recv_extra_mb:>8.0f}"
            f" {r.send_extra_mb:>8.0f} {r.shard_mb:>8.0f}"
        )
    return "\n".join(lines)


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
    parser.add_argument(
        "--state-mb",
        help="instead: heal time against state size, one Llama shape per size (MiB per group, comma-separated),"
        f" {HEAL_STEPS} steps, kill at {HEAL_KILL_AT}, restarted at once",
    )
    parser.add_argument("--transports", default="http,stream", help="with --state-mb: the heal transports to compare")
    parser.add_argument(
        "--restarts",
        default="job,torchrun,launch",
        help="with --state-mb: how the failed group comes back: 'launch' (fedshard launch) and 'torchrun' restart its"
        " ranks in place (--max-restarts), 'job' starts the failed job's command again",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.state_mb:
        restarts = args.restarts.split(",")
        if unknown := set(restarts) - set(RESTARTS):
            parser.error(f"--restarts: {', '.join(sorted(unknown))} is not one of {', '.join(RESTARTS)}")
        link = link_bytes_per_s()
        heals = []
        for size in args.state_mb.split(","):
            for transport, restart in itertools.product(args.transports.split(","), restarts):
                heals.append(heal_run(args.out, float(size), transport, overrides, restart))
                print(format_heal_table(heals[-1:], link), flush=True)
        table = format_heal_table(heals, link)
        print(table)
        (args.out / "heal.json").write_text(json.dumps({"link_bytes_per_s": link, "runs": [asdict(r) for r in heals]}))
        (args.out / "heal.txt").write_text(table + "\n")
        return
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
