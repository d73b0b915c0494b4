"""Fault tolerance on torchft: two federation groups of two gloo ranks each, one job per group, one Lighthouse.

One launch (tests/strategies/ft_worker.py) plays the whole story, and the tests below read its records: group 0
trains alone, group 1 joins late, then three times over one rank of group 1 is killed with SIGKILL mid-interval,
group 0 trains on alone, and group 1 is restarted and rejoins. In the main story group 1 runs under
``fedshard launch --max-restarts`` (torchrun's agent, workers forked from a warm interpreter), which restarts its
ranks in place: how a deployment comes back fastest, often before group 0 has left it out of a round; in the
one-rank stories the failed job exits and is started again. The groups train with DiLoCo's outer optimizer, so a
rejoining group must receive the global copies and the outer momentum as well as the parameters; and with shuffled
data and a learning rate that decays every step, so a rejoining group must also take the peers' step, learning rate
and data position.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_fedshard.distributed.processes import RunProcess
from tests.launching import REPO
from tests.strategies.ft_worker import NUM_SAMPLES, Indexed, lr_at

pytestmark = pytest.mark.multiproc

SYNC_EVERY = 4
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
CYCLES = 3  # kill → restart → rejoin cycles, as issue 17 asks (each ~25 s of interpreters starting)
WAIT_S = 240  # for any one thing to happen: interpreters importing torch on a loaded 2-core machine
HEARTBEAT_TIMEOUT_MS = 1500


@dataclass
class Group:
    """One group's job: its rank 0, whose Lightning launcher spawns rank 1, or with ``restarts_in_place`` a
    ``fedshard launch`` that starts the ranks and restarts them in place up to that many times."""

    index: int
    out: Path
    lighthouse: str
    restarts_in_place: int = 0
    launches: list[subprocess.Popen] = field(default_factory=list)
    _records: dict[Path, dict] = field(default_factory=dict)

    def start(self, **settings) -> None:
        config = self.out / f"g{self.index}_config{len(self.launches)}.json"
        config.write_text(
            json.dumps(
                {
                    "out": str(self.out),
                    "group": self.index,
                    "lighthouse": self.lighthouse,
                    "devices": 2,
                    "sync_every": SYNC_EVERY,
                    "outer_optimizer": "nesterov",
                    "timeout_s": 120,
                    "ft_timeout_s": 10,
                    "quorum_timeout_s": 120,
                    **settings,
                }
            )
        )
        launch = [
            "-m", "lightning_fedshard.cli", "launch", "--standalone", f"--nproc-per-node={settings.get('devices', 2)}",
            f"--max-restarts={self.restarts_in_place}", "--monitor-interval=0.1",
        ]  # fmt: skip
        with (self.out / f"g{self.index}_launch{len(self.launches)}.log").open("w") as log:
            self.launches.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        *(launch if self.restarts_in_place else []),
                        *("-m", "tests.strategies.ft_worker", str(config)),
                    ],
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    @property
    def launcher(self) -> subprocess.Popen:
        return self.launches[-1]

    def log(self, launch: int = -1) -> str:
        return (self.out / f"g{self.index}_launch{launch % len(self.launches)}.log").read_text(errors="replace")

    def started(self, rank: int) -> set[int]:
        """The pids of every process that ran as ``rank``, from the states they saved before joining."""
        return {int(path.stem.rpartition("start")[2]) for path in self.out.glob(f"g{self.index}_r{rank}_start*.pt")}

    def progress(self, rank: int) -> dict:
        path = self.out / f"g{self.index}_r{rank}.progress"
        return json.loads(path.read_text()) if path.exists() else {"optimizer_steps": -1, "pid": None}

    def rounds(self, rank: int = 0, pids: set[int] | None = None, groups: int | None = None) -> dict[int, Path]:
        """This rank's committed rounds by torchft round number (of the launches with ``pids`` and with ``groups``
        groups, if given), read from the record names."""
        found = {}
        for path in self.out.glob(f"g{self.index}_r{rank}_round*_committed_*.pt"):
            _, _, round_, in_round, _, pid = path.stem.split("_")
            if (pids is None or int(pid) in pids) and groups in (None, int(in_round.removeprefix("groups"))):
                found[int(round_.removeprefix("round"))] = path
        return found

    def reads(self, rank: int) -> dict[int, list[dict]]:
        """The training batches each launch's ``rank`` read, by launch pid."""
        return {
            int(path.stem.rpartition("data")[2]): json.loads(path.read_text())
            for path in self.out.glob(f"g{self.index}_r{rank}_data*.json")
        }

    def end(self, rank: int) -> dict:
        """Where ``rank`` stood when training ended (only a launch that was not killed gets there)."""
        (path,) = self.out.glob(f"g{self.index}_r{rank}_end*.json")
        return json.loads(path.read_text())

    def record(self, path: Path) -> dict:
        if path not in self._records:
            self._records[path] = torch.load(path, weights_only=True)
        return self._records[path]

    def kill_all(self) -> None:
        for launch in self.launches:
            if launch.poll() is None:
                # torchrun's workers are in sessions of their own: its agent ends them on SIGTERM
                os.killpg(launch.pid, signal.SIGTERM if self.restarts_in_place else signal.SIGKILL)
                try:
                    launch.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()


def parent(pid: int) -> tuple[int, str]:
    """The pid and command line of ``pid``'s parent process."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    return ppid, Path(f"/proc/{ppid}/cmdline").read_text().replace("\0", " ")


def wait_for(condition, what: str, groups: list[Group]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for group in groups:
            running = group.launcher.poll() is None
            assert running or group.launcher.returncode == 0, f"group {group.index} failed:\n{group.log()[-6000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s:\n" + "\n".join(
            g.log()[-3000:] for g in groups
        )
        time.sleep(0.2)


def play(out: Path, cycles: int, in_place: bool = False, **settings):
    """Group 0 trains alone, group 1 joins, then ``cycles`` times one rank of group 1 is killed, group 0 trains on
    alone and group 1 is restarted (``in_place``: by its ``fedshard launch``) and rejoins; yields the groups and what happened,
    and cleans up."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=50, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS
    )
    g0 = Group(0, out, lighthouse.address())
    g1 = Group(1, out, lighthouse.address(), restarts_in_place=cycles if in_place else 0)
    victim_rank = settings.get("devices", 2) - 1
    events: dict = {"outages": [], "g1_launch_pids": [], "g1_parents": []}
    try:
        g0.start(**settings)
        wait_for(lambda: len(g0.rounds(groups=1)) >= 2, "group 0 trains alone", [g0])
        for launch in range(cycles + 1):
            if launch:  # an outage: kill one rank of group 1 between its syncs, watch group 0 go on
                victim, survivor = g1.progress(victim_rank)["pid"], g1.progress(0)["pid"]
                before = max(g0.rounds())
                steps_before = g0.progress(0)["optimizer_steps"]
                os.kill(victim, signal.SIGKILL)
                if not in_place:
                    g1.launcher.wait(timeout=WAIT_S)
                for rank in {victim, survivor}:  # the agent stops the survivor, Lightning's launcher ends with it
                    wait_for(lambda: RunProcess.of(rank).state() in (None, "Z"), "the failed ranks are gone", [g0])
                if in_place:  # back within a heartbeat or two: group 0 need not see a round without it
                    wait_for(
                        lambda: g0.progress(0)["optimizer_steps"] > steps_before + SYNC_EVERY,
                        "group 0 trains on",
                        [g0],
                    )
                else:
                    wait_for(
                        lambda: sum(n > before for n in g0.rounds(groups=1)) >= 2,
                        "group 0 trains on alone",
                        [g0],
                    )
                events["outages"].append(
                    {
                        "after_round": before,
                        "steps_before": steps_before,
                        "steps_after": g0.progress(0)["optimizer_steps"],
                        "g1_returncode": g1.launcher.returncode,
                    }
                )
            if not (launch and in_place):
                g1.start(**settings)
            wait_for(lambda: g1.started(0) - set(events["g1_launch_pids"]), f"group 1 (launch {launch}) starts", [g1])
            (pid,) = g1.started(0) - set(events["g1_launch_pids"])
            events["g1_launch_pids"].append(pid)
            events["g1_parents"].append(parent(pid))
            # rank 0 of the launch holds its pid; it has rejoined once it committed its joining round and the next
            wait_for(lambda: len(g1.rounds(0, {pid})) >= 2, f"group 1 (launch {launch}) rejoins", [g0, g1])
        (out / "stop.json").write_text(json.dumps({"at_step": g0.progress(0)["optimizer_steps"] + 2 * SYNC_EVERY}))
        for group in (g0, g1):
            group.launcher.wait(timeout=WAIT_S)
        events["returncodes"] = [g0.launcher.returncode, g1.launcher.returncode]
        events["logs"] = [g0.log(), g1.log()]
        yield g0, g1, events
    finally:
        for group in (g0, g1):
            group.kill_all()
        lighthouse.shutdown()


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    yield from play(tmp_path_factory.mktemp("ft"), CYCLES, in_place=True)


@pytest.fixture(scope="module")
def compressed_story(tmp_path_factory):
    """The same with one rank per group and DynamiQ-compressed rounds (bits=5), one outage; each launch of group 1
    votes down its first round after joining."""
    yield from play(tmp_path_factory.mktemp("ft_dynamiq"), 1, devices=1, bits=5.0, fail_group=1, fail_round=1)


STREAMING = {
    "sync_schedule": "streaming",
    "fragments": 2,
    "fragment_sync_delay": 1,
    "fragment_update_alpha": 0.0,
    # the blocks are FSDP units of their own: the model has pieces to cut into fragments
    "auto_wrap": ["tests.strategies.worker.Block"],
}


@pytest.fixture(scope="module")
def streaming_story(tmp_path_factory):
    """The story under streaming sync (two fragments, one sent a step before it is due), one rank per group: each
    fragment's average is a torchft round of its own, so a kill lands mid-fragment."""
    yield from play(tmp_path_factory.mktemp("ft_streaming"), CYCLES, devices=1, streaming=STREAMING)


def nesterov_step(reference, momentum, mean_pseudo_grad):
    """torch.optim.SGD(nesterov=True) on one tensor, as the averager's outer step runs it."""
    buf = momentum * OUTER_MOMENTUM + mean_pseudo_grad
    return reference - OUTER_LR * (mean_pseudo_grad + OUTER_MOMENTUM * buf), buf


def test_the_surviving_group_trains_on_while_the_other_is_down(story):
    g0, _, events = story
    assert len(events["outages"]) == CYCLES
    for outage in events["outages"]:
        assert outage["g1_returncode"] is None  # the agent restarted the damaged group's ranks in place
    # every launch of group 1 was forked by one forkserver that had imported the training stack beforehand
    assert len({ppid for ppid, _ in events["g1_parents"]}) == 1, events["g1_parents"]
    for _, command in events["g1_parents"]:
        assert "multiprocessing.forkserver" in command and "'lightning_fedshard.training.cli'" in command, command
        # two solo rounds after a kill that may land just before a round boundary: at least one whole interval
        # and the step into it (e.g. killed at step 159: rounds at 160 and 164)
        assert outage["steps_after"] >= outage["steps_before"] + SYNC_EVERY + 1, outage
    # no error: it never stopped (torchft logs the all-reduce a kill cut short; that round is not applied)
    assert events["returncodes"] == [0, 0], events["logs"][0][-4000:]


def test_after_each_rejoin_both_groups_hold_the_reference_average(story):
    g0, g1, events = story
    joint_rounds = 0
    for rank in range(2):
        ours, theirs = g0.rounds(rank, groups=2), g1.rounds(rank, groups=2)
        # a round is applied by every group in it or by none, except one a kill cut between the two groups' votes
        assert len(ours.keys() ^ theirs.keys()) <= CYCLES, sorted(ours.keys() ^ theirs.keys())
        for n in sorted(ours.keys() & theirs.keys()):
            a, b = g0.record(ours[n]), g1.record(theirs[n])
            assert a["groups"] == b["groups"] == 2, n
            assert a["optimizer_steps"] == b["optimizer_steps"], n  # the healed group syncs at the same steps
            for part in ("reference", "momentum"):  # the global state the round starts from is the federation's
                for name in a["pre"][part]:
                    assert torch.equal(a["pre"][part][name], b["pre"][part][name]), (n, part, name)
            for name, reference in a["pre"]["reference"].items():
                mean = ((reference - a["pre"]["local"][name]) + (reference - b["pre"]["local"][name])) / 2
                expected, buf = nesterov_step(reference, a["pre"]["momentum"][name], mean)
                for post in (a["post"], b["post"]):
                    torch.testing.assert_close(post["local"][name], expected, rtol=0, atol=1e-6)
                    torch.testing.assert_close(post["reference"][name], expected, rtol=0, atol=1e-6)
                    torch.testing.assert_close(post["momentum"][name], buf, rtol=0, atol=1e-6)
                assert torch.equal(a["post"]["local"][name], b["post"]["local"][name]), (n, name)
            joint_rounds += rank == 0
    assert joint_rounds >= 2 * (CYCLES + 1), joint_rounds
    assert events["returncodes"] == [0, 0], events["logs"][1][-4000:]


def test_a_joining_group_starts_from_the_federations_state(story):
    g0, g1, events = story
    for pid in events["g1_launch_pids"]:
        joined = g1.rounds(0, {pid})
        first = min(joined)
        own_start = torch.load(g1.out / f"g1_r0_start{pid}.pt", weights_only=True)
        theirs = g0.record(g0.rounds(0)[first])
        mine = g1.record(joined[first])
        assert first > 0  # it joined a federation already under way, at its current round
        for name, start in own_start.items():
            # healed before contributing: what it averages is the federation's state, not its own initialisation
            assert not torch.equal(start, mine["pre"]["local"][name]), name
            assert torch.equal(mine["pre"]["local"][name], theirs["pre"]["local"][name]), name
            assert torch.equal(mine["post"]["local"][name], theirs["post"]["local"][name]), name


def test_below_min_groups_a_group_waits_with_a_log_line_then_gives_up_at_its_quorum_timeout(tmp_path):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=50)
    alone = Group(0, tmp_path, lighthouse.address())
    try:
        alone.start(devices=1, min_groups=2, quorum_timeout_s=4)
        alone.launcher.wait(timeout=WAIT_S)
    finally:
        alone.kill_all()
        lighthouse.shutdown()
    log = alone.log()
    assert alone.launcher.returncode != 0, log[-4000:]
    assert "federation group 0: waiting for at least min_groups=2 federation groups, 1 present" in log, log[-4000:]
    assert "TimeoutError: federation group 0: only 1 of the min_groups=2 federation groups joined within" in log
    assert alone.progress(0)["optimizer_steps"] == -1  # it never trained alone


def test_dynamiq_compressed_rounds_average_the_decoded_messages_and_survive_an_outage(compressed_story):
    """Each group's DiLoCo pseudo-gradient is encoded once at bits=5 and all-gathered over torchft's process group;
    both groups apply the mean of the decoded messages (a DynamiQ codec in this process, same bytes) and stay
    identical, through a kill and a rejoin."""
    from lightning_fedshard.dynamiq import DynamiQCodec

    g0, g1, events = compressed_story
    assert events["returncodes"] == [0, 0], events["logs"][0][-4000:]
    assert len(events["outages"]) == 1 and events["outages"][0]["g1_returncode"] != 0
    codec = DynamiQCodec(5.0)
    ours, theirs = g0.rounds(0, groups=2), g1.rounds(0, groups=2)
    joint = sorted(ours.keys() & theirs.keys())
    assert len(joint) >= 4, joint  # before the outage and after the rejoin
    for n in joint:
        a, b = g0.record(ours[n]), g1.record(theirs[n])
        names = list(a["pre"]["reference"])
        flat = [
            torch.cat([(r["pre"]["reference"][k] - r["pre"]["local"][k]).reshape(-1) for k in names]) for r in (a, b)
        ]
        numel = flat[0].numel()
        padded = [torch.nn.functional.pad(v, (0, -numel % codec.block)) for v in flat]
        decoded = [codec.decode(codec.encode(v, 1), v.numel(), 1) for v in padded]
        mean = ((decoded[0] + decoded[1]) / 2)[:numel]
        exact = (flat[0] + flat[1]) / 2
        assert not torch.equal(mean, exact)  # the round really went through the codec
        offset = 0
        for k in names:
            part = mean[offset : offset + a["pre"]["reference"][k].numel()].view_as(a["pre"]["reference"][k])
            offset += part.numel()
            expected, buf = nesterov_step(a["pre"]["reference"][k], a["pre"]["momentum"][k], part)
            for post in (a["post"], b["post"]):
                torch.testing.assert_close(post["local"][k], expected, rtol=0, atol=1e-6)
                torch.testing.assert_close(post["momentum"][k], buf, rtol=0, atol=1e-6)
            assert torch.equal(a["post"]["local"][k], b["post"]["local"][k]), (n, k)


def test_a_federation_restarted_whole_resumes_from_its_checkpoints(tmp_path):
    """Both groups save a checkpoint between two rounds and stop; restarted from their checkpoints, they continue
    where they were: the same shards, the same outer state, the optimizer-step and torchft round counters."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, quorum_tick_ms=50)
    groups = [Group(i, tmp_path, lighthouse.address()) for i in range(2)]
    checkpoints = {g.index: dict(devices=1, checkpoint=str(tmp_path / f"g{g.index}.ckpt")) for g in groups}
    stop = tmp_path / "stop.json"
    try:
        for g in groups:
            g.start(**checkpoints[g.index])
        wait_for(lambda: all(len(g.rounds(groups=2)) >= 2 for g in groups), "both groups train together", groups)
        # half-way through an interval: the checkpoint holds local steps the next round has not seen yet
        saved_at = (max(g.progress(0)["optimizer_steps"] for g in groups) // SYNC_EVERY + 2) * SYNC_EVERY + 2
        stop.write_text(json.dumps({"at_step": saved_at}))
        for g in groups:
            g.launcher.wait(timeout=WAIT_S)
            assert g.launcher.returncode == 0, g.log()[-4000:]
        stop.write_text(json.dumps({"at_step": saved_at + 2 * SYNC_EVERY}))
        for g in groups:
            g.start(devices=1, resume=checkpoints[g.index]["checkpoint"])
        for g in groups:
            g.launcher.wait(timeout=WAIT_S)
            assert g.launcher.returncode == 0, g.log()[-4000:]
    finally:
        for g in groups:
            g.kill_all()
        lighthouse.shutdown()

    for g in groups:
        saved_pid, resumed_pid = (launch.pid for launch in g.launches)
        saved = torch.load(tmp_path / f"g{g.index}_r0_saved{saved_pid}.pt", weights_only=True)
        resumed_start = torch.load(tmp_path / f"g{g.index}_r0_start{resumed_pid}.pt", weights_only=True)
        for name, local in saved["local"].items():
            assert torch.equal(resumed_start[name], local), name  # restored from disk, bit for bit
        # The first run ended with the round of its last steps, after the checkpoint; the resumed run's joining
        # round is that round again: the same torchft round number, optimizer step and state, the same result.
        before, after = g.rounds(0, {saved_pid}), g.rounds(0, {resumed_pid})
        ended, rejoined = g.record(before[max(before)]), g.record(after[min(after)])
        assert min(after) == max(before), (sorted(before), sorted(after))
        assert ended["optimizer_steps"] == rejoined["optimizer_steps"] == saved_at
        assert rejoined["groups"] == 2
        for part in ("local", "reference", "momentum"):  # DiLoCo's outer state came back from the checkpoint too
            for name, tensor in saved[part].items():
                assert torch.equal(rejoined["pre"][part][name], tensor), (part, name)
                assert torch.equal(rejoined["post"][part][name], ended["post"][part][name]), (part, name)
        assert max(after) > min(after)  # and it trained on together past the checkpoint


BATCH = 4  # the worker's batch size


def expected_batch(group: int, rank: int, ranks: int, epoch: int, batch: int) -> list[int]:
    """What rank ``rank`` of group ``group`` reads as batch ``batch`` of ``epoch`` in one job of both groups, from
    torch's DistributedSampler as Lightning sets it up (shuffled, seed 0, the epoch set before each pass)."""
    sampler = DistributedSampler(Indexed(), num_replicas=2 * ranks, rank=group * ranks + rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)[batch * BATCH : (batch + 1) * BATCH]


def test_each_group_reads_its_own_part_the_part_it_reads_without_fault_tolerance(compressed_story, tmp_path):
    """Two groups under fault tolerance (one rank each) and the same two groups as one job without it (real gloo
    processes): at every global step the groups' batches are disjoint, their union is the one job's, and each
    group's batch is what the one job's group reads; a group restarted after a kill reads on where it should."""
    g0, g1, events = compressed_story
    assert events["returncodes"] == [0, 0], events["logs"][1][-4000:]
    steps = g0.end(0)["global_step"]  # some ten epochs of 32 batches
    reference = Group("nf", tmp_path, "")
    # what a rank reads does not depend on the rounds: the reference runs without any until the end, for speed
    reference.start(devices=2, fault_tolerance=False, max_steps=steps, sync_every=steps, timeout_s=120, step_sleep_s=0)
    try:
        reference.launcher.wait(timeout=WAIT_S)
    finally:
        reference.kill_all()
    assert reference.launcher.returncode == 0, reference.log()[-4000:]

    def by_step(group: Group, rank: int = 0) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        for reads in group.reads(rank).values():
            for read in reads:
                assert found.setdefault(read["step"], read["index"]) == read["index"], read  # no step read twice
        return found

    without = [by_step(reference, rank) for rank in range(2)]  # rank g of the one job is group g
    assert sorted(without[0]) == list(range(steps))
    ours, theirs = by_step(g0), by_step(g1)
    joint = sorted(set(ours) & set(theirs))
    assert len(joint) >= 8 and sorted(ours) == list(range(steps)), (sorted(ours), sorted(theirs))
    for step in joint:
        assert not set(ours[step]) & set(theirs[step]), step  # the groups read different samples
        assert set(ours[step]) | set(theirs[step]) == set(without[0][step]) | set(without[1][step]), step
        assert (ours[step], theirs[step]) == (without[0][step], without[1][step]), step
    # every batch read under fault tolerance, through the kill and the rejoin, is the one job's at that step
    for group, reads in ((0, ours), (1, theirs)):
        for step, index in reads.items():
            assert index == expected_batch(group, 0, 1, *divmod(step, NUM_SAMPLES // 2 // BATCH)), (group, step)


def test_a_healed_group_goes_on_from_the_peers_step_learning_rate_and_data(story):
    """Group 1 joins late and is restarted three times: each launch takes group 0's global step, learning-rate
    schedule and data position when it heals, reads from there exactly the batches it would have read without the
    failures (no batch replayed or skipped), and both groups stop at the same step with the same learning rate."""
    g0, g1, events = story
    assert events["returncodes"] == [0, 0], events["logs"][1][-4000:]
    per_epoch = NUM_SAMPLES // 4 // BATCH
    for rank in range(2):
        launches = g1.reads(rank)
        assert len(launches) == CYCLES + 1
        for pid, reads in launches.items():
            joined = g1.rounds(rank, {pid}) if rank == 0 else None
            if joined:  # the joining round's step: the federation's, and the launch's first batch is the next one
                first_round = g1.record(joined[min(joined)])
                assert first_round["optimizer_steps"] > 0
                assert reads[0]["step"] == first_round["optimizer_steps"], (pid, reads[0])
            steps = [read["step"] for read in reads]
            assert steps == list(range(steps[0], steps[0] + len(steps))), pid  # one batch per step, in order
            for read in reads:
                epoch, batch = divmod(read["step"], per_epoch)
                assert (read["epoch"], read["batch"]) == (epoch, batch), (pid, read)
                assert read["index"] == expected_batch(1, rank, 2, epoch, batch), (pid, read)
        for read in next(iter(g0.reads(rank).values())):  # the group that never failed reads by the same rule
            assert read["index"] == expected_batch(0, rank, 2, *divmod(read["step"], per_epoch)), read
        ours, theirs = g0.end(rank), g1.end(rank)
        assert theirs["global_step"] == ours["global_step"] == ours["optimizer_steps"] == theirs["optimizer_steps"]
        assert theirs["lr"] == ours["lr"] == pytest.approx(lr_at(ours["global_step"]), rel=1e-12)


def test_a_round_voted_down_leaves_the_group_as_before_it_and_the_group_heals(compressed_story):
    """Group 1 votes down a round (an error reported to its Manager after the average, as a peer dying inside it
    would) while group 0 applies it: group 1's shards, global copies and momentum after the round are those from
    before it, bit for bit (the round is applied only after the vote), and at its next round it heals from group 0
    and both apply the same round again."""
    g0, g1, events = compressed_story
    assert events["returncodes"] == [0, 0], events["logs"][1][-4000:]
    dropped = sorted(g1.out.glob("g1_r0_round*_dropped_*.pt"))
    assert len(dropped) == len(events["g1_launch_pids"]), dropped  # one per launch
    for path in dropped:
        record = torch.load(path, weights_only=True)
        assert record["groups"] == 2
        for part in ("local", "reference", "momentum"):
            for name, before in record["pre"][part].items():
                assert torch.equal(record["post"][part][name], before), (path.name, part, name)
        ours, theirs = g0.rounds(0), g1.rounds(0)
        assert record["round"] in ours and record["round"] not in theirs  # group 0 applied it
        after = g1.record(theirs[record["round"] + 1])  # group 1's next round: healed from group 0 first
        assert torch.equal(
            torch.cat([t.reshape(-1) for t in after["pre"]["reference"].values()]),
            torch.cat([t.reshape(-1) for t in g0.record(ours[record["round"] + 1])["pre"]["reference"].values()]),
        )


def test_streaming_fragment_rounds_survive_kills_and_each_committed_one_is_the_reference_step(streaming_story):
    """Under streaming sync, through three kills mid-training: group 0 trains on alone; every fragment round both
    groups committed took the same fragment at the same step from the same global state, and left that
    fragment's parameters bitwise equal on both groups and equal to DiLoCo's Nesterov step on the mean
    pseudo-gradient, computed here from the two groups' contributions."""
    g0, g1, events = streaming_story
    assert events["returncodes"] == [0, 0], events["logs"][0][-4000:] + events["logs"][1][-4000:]
    assert len(events["outages"]) == CYCLES
    for outage in events["outages"]:
        assert outage["g1_returncode"] != 0
        assert outage["steps_after"] > outage["steps_before"], outage  # the survivor kept training
    ours, theirs = g0.rounds(groups=2), g1.rounds(groups=2)
    assert len(ours.keys() ^ theirs.keys()) <= CYCLES, sorted(ours.keys() ^ theirs.keys())
    fragments_seen = set()
    for n in sorted(ours.keys() & theirs.keys()):
        a, b = g0.record(ours[n]), g1.record(theirs[n])
        assert (a["fragment"], a["optimizer_steps"], a["names"]) == (b["fragment"], b["optimizer_steps"], b["names"])
        fragments_seen.add(a["fragment"])
        for name in a["names"]:
            for part in ("reference", "momentum"):
                assert torch.equal(a["pre"][part][name], b["pre"][part][name]), (n, part, name)
            reference = a["pre"]["reference"][name]
            mean = ((reference - a["pre"]["local"][name]) + (reference - b["pre"]["local"][name])) / 2
            expected, buf = nesterov_step(reference, a["pre"]["momentum"][name], mean)
            for post in (a["post"], b["post"]):
                torch.testing.assert_close(post["local"][name], expected, rtol=0, atol=1e-6)
                torch.testing.assert_close(post["momentum"][name], buf, rtol=0, atol=1e-6)
            assert torch.equal(a["post"]["local"][name], b["post"]["local"][name]), (n, name)
    assert {0, 1} <= fragments_seen, fragments_seen  # both fragments' rounds, not only whole-model ones


def test_under_streaming_a_rejoining_group_heals_at_a_send_point_and_joins_that_fragments_round(streaming_story):
    g0, g1, events = streaming_story
    assert events["returncodes"] == [0, 0], events["logs"][1][-4000:]
    for pid in events["g1_launch_pids"]:
        joined = g1.rounds(0, {pid})
        first = min(joined)
        own_start = torch.load(g1.out / f"g1_r0_start{pid}.pt", weights_only=True)
        mine, theirs = g1.record(joined[first]), g0.record(g0.rounds(0)[first])
        assert first > 0 and mine["fragment"] == theirs["fragment"] is not None, (first, mine["fragment"])
        assert mine["optimizer_steps"] == theirs["optimizer_steps"]
        for name, start in own_start.items():  # healed from group 0 before contributing
            assert not torch.equal(start, mine["pre"]["local"][name]), name
            assert torch.equal(mine["pre"]["local"][name], theirs["pre"]["local"][name]), name
        for part in ("reference", "momentum"):
            for name, tensor in theirs["pre"][part].items():
                assert torch.equal(mine["pre"][part][name], tensor), (part, name)
    # the end of fit: one whole-model round, which both groups committed, leaves them equal
    last = max(g0.rounds(groups=2).keys() & g1.rounds(groups=2).keys())
    a, b = g0.record(g0.rounds()[last]), g1.record(g1.rounds()[last])
    assert a["fragment"] is None and len(a["names"]) == len(a["post"]["local"])
    for name, tensor in a["post"]["local"].items():
        assert torch.equal(tensor, b["post"]["local"][name]), name
