"""Federation groups that survive failures: the cross-group average through a torchft ``Manager``.

With fault tolerance each federation group is a job of its own (its own ``torchrun``, its own world of R × S ranks)
and one torchft replica group. A torchft Lighthouse keeps the membership: at every round each rank asks its
group's ``Manager`` for a quorum, averages its shards with rank k of every live group over a torchft process group
that is rebuilt whenever the quorum changes, and applies the round only if every rank of its group agrees
(``should_commit``). A group that died is left out once its heartbeat expires; a group that (re)starts heals from a
live peer through torchft's checkpoint transport (parameters, outer-optimizer state and the round counters) and
then trains in step with the others. The Manager owns membership: the strategy asks it who is present, never
guesses.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_fedshard.compat import (
    _set_sampler_epoch,
    epoch_loop_ready_batches_reached,
    fit_loop_training_data,
    require_extra,
)
from lightning_fedshard.distributed.timeouts import check_timeout
from lightning_fedshard.dynamiq.codec import Codec
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = ["FaultTolerance", "FederationMember", "ManagerTransport", "load_trainer_progress", "trainer_progress"]

log = logging.getLogger(__name__)

#: The environment variables a :class:`FaultTolerance` field is read from when it is not given.
ENV = {
    "lighthouse": "TORCHFT_LIGHTHOUSE",
    "group_id": "REPLICA_GROUP_ID",
    "num_groups": "NUM_REPLICA_GROUPS",
    "min_groups": "TORCHFT_MIN_GROUPS",
    "timeout": "TORCHFT_TIMEOUT_SEC",
    "quorum_timeout": "TORCHFT_QUORUM_TIMEOUT_SEC",
    "connect_timeout": "TORCHFT_CONNECT_TIMEOUT_SEC",
}
T = TypeVar("T")
#: Rounds :attr:`FederationMember.rounds_log` keeps.
ROUNDS_LOGGED = 64

#: Seconds between two quorum requests of a group that waits for ``min_groups``.
MIN_GROUPS_POLL_S = 1.0
#: The values of :attr:`FaultTolerance.heal_transport`.
HEAL_TRANSPORTS = ("stream", "http")


@dataclass(frozen=True)
class FaultTolerance:
    """Where a federation group finds the others and how long it waits for them (torchft).

    Every field left as ``None`` is read from the environment (:data:`ENV`) when the strategy starts; the
    torchft variables ``TORCHFT_*_TIMEOUT_SEC`` override a given timeout, as they do inside torchft itself.

    Arguments:
        lighthouse: The torchft Lighthouse, ``http://host:port`` (``TORCHFT_LIGHTHOUSE``).
        group_id: This federation group's number, an integer ≥ 0 unique among the groups (``REPLICA_GROUP_ID``).
            Rank k of group g meets rank k of every other group; all groups must shard alike.
        num_groups: How many federation groups the federation has (``NUM_REPLICA_GROUPS``, the name torchft's
            examples use), ``group_id < num_groups``. The data is split into this many parts, one per group, as
            one job of ``num_groups`` groups would split it: group g's rank r reads part ``g · R·S + r`` of
            ``num_groups · R·S``. It is the planned size, not who is present: the Manager counts those at every
            round, and a round with more groups present than ``num_groups`` is refused (they would read the same
            data).
        min_groups: Groups a round needs (``TORCHFT_MIN_GROUPS``, default 1). With fewer, the group waits at its
            next round, logging who is missing, for at most ``quorum_timeout``.
        timeout: How long one cross-group all-reduce, commit vote or checkpoint transfer waits (default 60 s):
            also how long a frozen peer can hold a round before it is left out.
        quorum_timeout: How long a round waits for its quorum (default 15 min). It must cover the Lighthouse's
            heartbeat timeout plus one sync interval plus the time a restarted group takes to start.
        connect_timeout: How long connecting to the Lighthouse and the group's Manager may take (default 60 s).
        heartbeat_interval: How often the group tells the Lighthouse that it is alive (default 100 ms).
        heal_transport: How a healing group receives a live peer's state: ``"stream"`` (default) sends every
            tensor from the peer's live shards straight into the healing group's own, in chunks, over the quorum's
            process group, with no copy of the state on either side
            (:class:`~lightning_fedshard.strategies.heal_transport.StreamingTransport`); ``"http"`` is torchft's
            HTTP transport, which pickles a copy of the state and unpickles it into new tensors (twice the memory,
            a Python socket loop; kept to compare against).

    Example::

        ft = FaultTolerance(lighthouse="http://head:29510", group_id=0, num_groups=2, min_groups=2)
        trainer = Trainer(strategy=FLFSDPStrategy(sync_every=8, fault_tolerance=ft), devices=4)
        trainer = Trainer(strategy=FLFSDPStrategy(fault_tolerance=FaultTolerance()))  # all from the environment
    """

    lighthouse: str | None = None
    group_id: int | None = None
    num_groups: int | None = None
    min_groups: int | None = None
    timeout: timedelta | None = None
    quorum_timeout: timedelta | None = None
    connect_timeout: timedelta | None = None
    heartbeat_interval: timedelta = field(default=timedelta(milliseconds=100))
    heal_transport: str = "stream"

    def resolve(self, environ: dict[str, str] | None = None) -> FaultTolerance:
        """Every field filled in (from the environment where not given) and checked; a clear error otherwise."""
        env = os.environ if environ is None else environ
        name = type(self).__name__
        require_extra("torchft", "ft", f"{name} (fault-tolerant federation groups)")
        lighthouse = self.lighthouse or env.get(ENV["lighthouse"])
        if not lighthouse:
            raise ValueError(
                f"{name}: no Lighthouse address; pass lighthouse='http://host:port' or set {ENV['lighthouse']}"
                " (start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`)."
            )
        group_id = self.group_id if self.group_id is not None else _env_int(env, "group_id", name)
        if group_id is None:
            raise ValueError(f"{name}: no federation group id; pass group_id=<k> or set {ENV['group_id']}.")
        _check_count(group_id, "group_id", 0, name)
        num_groups = self.num_groups if self.num_groups is not None else _env_int(env, "num_groups", name)
        if num_groups is None:
            raise ValueError(
                f"{name}: no federation size; pass num_groups=<F> or set {ENV['num_groups']}: each group reads"
                " its own 1/F of the data (without it every group would read the same samples)."
            )
        _check_count(num_groups, "num_groups", 1, name)
        if group_id >= num_groups:
            raise ValueError(f"{name}: `group_id`={group_id} must be below `num_groups`={num_groups}.")
        min_groups = self.min_groups if self.min_groups is not None else _env_int(env, "min_groups", name)
        min_groups = 1 if min_groups is None else min_groups
        _check_count(min_groups, "min_groups", 1, name)
        if min_groups > num_groups:
            raise ValueError(f"{name}: `min_groups`={min_groups} is more than `num_groups`={num_groups}.")
        timeouts = {
            key: _env_seconds(env, key, name) or check_timeout(getattr(self, key), f"{name}.{key}") or default
            for key, default in (
                ("timeout", timedelta(seconds=60)),
                ("quorum_timeout", timedelta(minutes=15)),
                ("connect_timeout", timedelta(seconds=60)),
            )
        }
        heartbeat = check_timeout(self.heartbeat_interval, f"{name}.heartbeat_interval")
        if self.heal_transport not in HEAL_TRANSPORTS:
            raise ValueError(
                f"{name}: `heal_transport` must be one of {', '.join(map(repr, HEAL_TRANSPORTS))},"
                f" got {self.heal_transport!r}."
            )
        return replace(
            self, lighthouse=lighthouse, group_id=group_id, num_groups=num_groups, min_groups=min_groups,
            heartbeat_interval=heartbeat, **timeouts,
        )  # fmt: skip

    @property
    def replica_id(self) -> str:
        """torchft's replica id: torchft numbers the ranks of its process groups by the id's trailing digits."""
        return f"fedgroup_{self.group_id}"


class ManagerTransport:
    """The averager's cross-group all-reduce through a torchft ``Manager``: the mean over the groups in the
    current quorum (torchft sums, then divides by the number of participants it counted for this round).

    A failed all-reduce does not raise: torchft records the error, the round's ``should_commit`` vote fails and
    :class:`FederationMember` does not apply the round.

    With DynamiQ (:meth:`start_compressed_mean_`) each group encodes its contribution once and the messages are
    all-gathered over the Manager's process group (``pg``, reconfigured by torchft at every quorum); every group
    decodes them in quorum order and sums in fp32, so the same bytes give the same mean, bit for bit, in every
    group. DynamiQ's multi-hop ring needs a process group registered with ``torch.distributed`` and fixed for the
    job, which torchft's is not; with two groups the all-gather sends what the ring would.
    """

    def __init__(self, manager: Any, pg: Any) -> None:
        self.manager = manager
        self.pg = pg

    def size(self) -> int:
        return self.manager.num_participants()

    def start_mean_(self, flat: torch.Tensor) -> Any:
        return self.manager.allreduce(flat)  # a torchft Work: waited for when the average is applied

    def start_compressed_mean_(
        self, flat: torch.Tensor, compression: Compression, codec: Codec, stats: CompressionStats
    ) -> Any:
        """Turns ``flat`` into the mean of the groups' decoded messages, in place, and returns None: done here. A
        group alone, and tensors shorter than ``compression.min_numel``, take the plain all-reduce (exact), whose
        work is returned."""
        manager = self.manager
        groups = manager.num_participants()
        if groups == 1 or flat.numel() < compression.min_numel:
            coords = 2 * (groups - 1) / groups * flat.numel()
            stats.record(flat.numel(), coords * flat.element_size(), coords, compressed=False)
            return self.start_mean_(flat)
        if manager.errored():
            return None  # the round is lost already: its vote fails and it is not applied
        from torch.distributed.distributed_c10d import AllgatherOptions

        padded = flat.new_zeros(flat.numel() + -flat.numel() % codec.block, dtype=torch.float32)
        if manager.is_participating():  # as in torchft's all-reduce, a group not in the round adds zeros (decoded: 0)
            padded[: flat.numel()] = flat
        msg = codec.encode(padded, 1)
        gathered = [torch.empty_like(msg) for _ in range(self.pg.size())]
        try:
            work = self.pg.allgather([gathered], [msg], AllgatherOptions())
            manager.wrap_future(work.get_future(), None).wait()
        except Exception as error:  # noqa: BLE001 -- torchft's contract: report, then the vote fails the round
            manager.report_error(error)
        if manager.errored():
            return None
        total = torch.zeros_like(padded)
        for message in gathered:  # quorum order on every group: the same sum to the bit
            total += codec.decode(message, padded.numel(), 1)
        flat.copy_((total / groups)[: flat.numel()])
        # the bytes this rank sends (gloo's all-gather forwards each message around the ring) against a plain ring's
        stats.record(padded.numel(), (groups - 1) * msg.numel(), 2 * (groups - 1) / groups * padded.numel(), True)
        return None


class FederationMember:
    """One rank's membership in the federation: its torchft ``Manager``, the rounds it runs and what it hands a
    group that heals from it.

    ``params`` are the FSDP parameters (DTensors), ``outer_state`` / ``load_outer_state`` the averager's global
    copies and outer momentum, and ``progress`` / ``load_progress`` where training stands: the strategy's round
    counters (optimizer steps, syncs) and the trainer's step, learning-rate schedulers and data position, so that
    a healed group syncs at the same steps as the others, reads on where they read and stops with them.

    Example::

        member = FederationMember(ft.resolve(), rank=0, world_size=2, params=model.named_parameters(), ...)
        committed = member.run_round(average, apply)  # every rank of the group calls it at the same step
    """

    def __init__(
        self,
        config: FaultTolerance,
        *,
        rank: int,
        world_size: int,
        params: list[tuple[str, nn.Parameter]],
        outer_state: Callable[[], dict[str, dict[str, DTensor]]],
        load_outer_state: Callable[[dict[str, dict[str, DTensor]]], None],
        progress: Callable[[], dict[str, Any]],
        load_progress: Callable[[dict[str, Any]], None],
        backend: str = "gloo",
    ) -> None:
        require_extra("torchft", "ft", f"{type(config).__name__} (fault-tolerant federation groups)")
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing import HTTPTransport

        from lightning_fedshard.strategies.heal_transport import StreamingTransport

        self.config = config
        self._params = params
        self._outer_state = outer_state
        self._load_outer_state = load_outer_state
        self._progress = progress
        self._load_progress = load_progress
        timeout = config.timeout
        assert timeout is not None and config.quorum_timeout is not None, "resolve() the FaultTolerance first"
        pg = ProcessGroupNCCL(timeout=timeout) if backend == "nccl" else ProcessGroupGloo(timeout=timeout)
        # the live state the stream transport receives into: the Manager's tree of what _state_dict gives the peer
        live_state = lambda: {"user": {"default": self._state_dict()}, "torchft": self.manager.state_dict()}  # noqa: E731
        self._streamed = config.heal_transport == "stream"
        self.transfers = _TimedTransport(
            StreamingTransport(pg, timeout, live_state)
            if self._streamed
            else HTTPTransport(timeout=timeout, num_chunks=0)
        )
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=config.min_groups,
            use_async_quorum=False,  # a sync quorum: the divisor is every group present, healing happens first
            timeout=timeout,
            quorum_timeout=config.quorum_timeout,
            connect_timeout=config.connect_timeout,
            rank=rank,
            world_size=world_size,
            lighthouse_addr=config.lighthouse,
            replica_id=config.replica_id,
            hostname=socket.gethostname(),
            heartbeat_interval=config.heartbeat_interval,
            init_sync=True,  # groups start from one model: torchft heals every group at step 0 from the others
            checkpoint_transport=self.transfers,
        )
        self.transport = ManagerTransport(self.manager, pg)
        self.rounds_failed = 0
        self.last_participants = 0
        self.rounds_log: deque[dict[str, Any]] = deque(maxlen=ROUNDS_LOGGED)
        """The last rounds of this rank, one record each, wall-clock (``time.time()``) times: ``quorum_start``,
        ``quorum_end``, ``end`` (applied or not), ``participants`` and ``transfers`` (the checkpoint sends and
        receives during the quorum: ``role``, ``start``, ``end``); with :attr:`track_memory` also ``rss_kb`` before the quorum and the peak resident memory during
        the quorum (``quorum_peak_kb``, where a heal is received) and during the whole round (``peak_kb``).
        ``fedshard bench faults`` splits a heal into its phases with them."""
        self.track_memory = False

    def run_round(self, average: Callable[[], T], apply: Callable[[T], None]) -> bool:
        """One cross-group round: quorum (healing this group first if it is behind), ``average``, the group's
        vote, then ``apply`` if the vote passed. Returns whether the round was applied.

        ``average`` must leave the model and the outer state untouched: it returns the finished averages in
        buffers of its own (waited for, so that a failed all-reduce has reached the vote), and only ``apply``
        writes them back. A failed vote therefore leaves the state as it was before the round with nothing to
        restore, as torchft's own DiLoCo votes before its outer step: no copy of the parameters, global copies
        and momentum is kept during the round.
        """
        return self.end_round(self.start_round(average), apply)

    def _log_round_start(self) -> None:
        record: dict[str, Any] = {"quorum_start": time.time()}
        if self.track_memory:
            record["rss_kb"] = _reset_peak_rss()
        self.rounds_log.append(record)
        self.transfers.events.clear()

    def _log_round_end(self) -> None:
        record = self.rounds_log[-1]
        record["end"] = time.time()
        if self.track_memory:
            record["peak_kb"] = _proc_status_kb("VmHWM")

    def start_round(self, start: Callable[[], T]) -> T:
        """The first half of a round whose average overlaps training (a streaming fragment): the quorum (healing
        this group first if it is behind), then ``start``, which sends the average without waiting for it and,
        like ``run_round``'s ``average``, leaves the model and the outer state untouched. The group trains on
        until :meth:`end_round`; no other round may start in between."""
        self._log_round_start()
        self._start_quorum()
        self.rounds_log[-1].update(
            quorum_end=time.time(), participants=self.last_participants, transfers=list(self.transfers.events)
        )
        if self.track_memory:
            self.rounds_log[-1]["quorum_peak_kb"] = _proc_status_kb("VmHWM")
        if self.transfers.torn:
            raise RuntimeError(
                f"federation group {self.config.group_id}: healing from a peer broke off after part of its state had"
                " been received into this group's tensors, which now mix the two; the group stops rather than train"
                " on that. Restart it: it heals afresh from a live group."
            )
        return start()

    def end_round(self, started: T, apply: Callable[[T], None], wait: Callable[[T], None] | None = None) -> bool:
        """The second half: ``wait`` for the average (so a failed all-reduce reaches the vote), the group's vote,
        then ``apply`` if it passed. Returns whether the round was applied; a round voted down changes nothing."""
        if wait is not None:
            wait(started)
        committed = self.manager.should_commit()
        if committed:
            apply(started)
        self._log_round_end()
        if committed:
            return True
        self.rounds_failed += 1
        log.warning(
            "federation group %s: round %d was not applied (a peer failed or too few groups); the group keeps its"
            " state from before the round and rejoins at the next one",
            self.config.group_id,
            self.manager.current_step(),
        )
        return False

    def _start_quorum(self) -> None:
        deadline = time.monotonic() + self.config.quorum_timeout.total_seconds()
        waiting_since = None
        while True:
            self.manager.start_quorum(timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
            present = self.manager.num_participants()
            self.last_participants = present
            if present > self.config.num_groups:
                raise RuntimeError(
                    f"federation group {self.config.group_id}: the Lighthouse {self.config.lighthouse} counts"
                    f" {present} groups in this round, more than num_groups={self.config.num_groups}: the data is"
                    f" split into {self.config.num_groups} parts, so some groups would train on the same samples."
                    " Give every group the same num_groups (NUM_REPLICA_GROUPS), the federation's size, and"
                    " distinct group ids below it."
                )
            if present >= self.config.min_groups:
                if waiting_since is not None:
                    log.warning(
                        "federation group %s: %d groups present after %.1f s, training goes on",
                        self.config.group_id,
                        present,
                        time.monotonic() - waiting_since,
                    )
                return
            if waiting_since is None:
                waiting_since = time.monotonic()
                log.warning(
                    "federation group %s: waiting for at least min_groups=%d federation groups, %d present"
                    " (quorum_timeout %s)",
                    self.config.group_id,
                    self.config.min_groups,
                    present,
                    self.config.quorum_timeout,
                )
            if time.monotonic() + MIN_GROUPS_POLL_S > deadline:
                raise TimeoutError(
                    f"federation group {self.config.group_id}: only {present} of the min_groups="
                    f"{self.config.min_groups} federation groups joined within quorum_timeout="
                    f"{self.config.quorum_timeout}; check that the other groups' jobs run and reach the Lighthouse"
                    f" {self.config.lighthouse}."
                )
            time.sleep(MIN_GROUPS_POLL_S)

    # ---- what a healing group receives ------------------------------------------------------------------

    @torch.no_grad()
    def _state_dict(self) -> dict[str, Any]:
        # The stream transport sends from the live tensors and has sent everything when the quorum returns (and
        # receives into them). torchft's HTTP transport serves the tensors by reference while this rank trains on:
        # clones for it.
        local = (lambda t: t.to_local().detach()) if self._streamed else (lambda t: t.to_local().detach().clone())
        return {
            "params": {name: local(p) for name, p in self._params},
            "outer": {
                part: {name: local(t) for name, t in tensors.items()} for part, tensors in self._outer_state().items()
            },
            "progress": self._progress(),
        }

    def state_bytes(self) -> int:
        """Bytes of the tensors this rank sends a healing peer (its shards of the parameters and outer state)."""
        tensors = [p for _, p in self._params] + [t for part in self._outer_state().values() for t in part.values()]
        return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors)

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self._params)
        if state["params"].keys() != params.keys():
            raise ValueError(
                f"federation group {self.config.group_id}: the peer's parameters"
                f" {sorted(set(state['params']) ^ set(params))} differ from this model's; every group must train"
                " the same model with the same sharding."
            )
        for name, p in self._params:
            p.to_local().copy_(state["params"][name])  # nothing to do where the stream received into p itself
        self._load_outer_state(
            {
                part: {name: _like(params[name], t) for name, t in tensors.items()}
                for part, tensors in state["outer"].items()
            }
        )
        self._load_progress(state["progress"])

    # ---- checkpoints and shutdown -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """torchft's round counter, for this group's own checkpoints (torchft requires it on resume)."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class _TimedTransport:
    """A torchft checkpoint transport with the times of its sends and receives (``events``: ``role``, ``start``,
    ``end``). A send of torchft's HTTP transport only offers the state: the peer reads it during the round."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[dict[str, Any]] = []

    @property
    def torn(self) -> bool:
        return getattr(self.inner, "torn", False)

    def metadata(self) -> str:
        return self.inner.metadata()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        start = time.time()
        self.inner.send_checkpoint(dst_ranks, step, state_dict, timeout)
        self.events.append({"role": "send", "start": start, "end": time.time()})

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        start = time.time()
        state = self.inner.recv_checkpoint(src_rank, metadata, step, timeout)
        self.events.append({"role": "recv", "start": start, "end": time.time()})
        return state

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait)


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def _reset_peak_rss() -> int:
    """Restarts the kernel's count of this process's peak resident memory (``VmHWM``); returns the resident memory
    now, in KiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _proc_status_kb("VmRSS")


def _like(param: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _check_count(value: object, arg: str, minimum: int, owner: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}: `{arg}` must be an integer ≥ {minimum}, got {value!r}.")


def _env_int(env: Any, key: str, owner: str) -> int | None:
    text = env.get(ENV[key])
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{owner}: {ENV[key]}={text!r} is not an integer.") from None


def _env_seconds(env: Any, key: str, owner: str) -> timedelta | None:
    text = env.get(ENV[key])
    if text is None or text == "":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{owner}: {ENV[key]}={text!r} is not a number of seconds.") from None
    if not seconds > 0:
        raise ValueError(f"{owner}: {ENV[key]}={text!r} must be a positive number of seconds.")
    return timedelta(seconds=seconds)


# ---- where training stands: what a healing group takes besides the model -------------------------------------


def trainer_progress(trainer: Any, in_step: bool) -> dict[str, Any]:
    """The trainer's position for a group that heals from this one: Lightning's loop progress (global step, epoch,
    batches read), the learning-rate schedulers and the optimizers' scheduled hyperparameters (learning rate,
    momentum, ...: the ``param_groups`` entries other than the parameters).

    ``in_step`` says that the round runs inside an optimizer step (the usual case), whose end (optimizer step and
    batch counted, step-interval schedulers stepped) Lightning has not reached yet; the healed group completes it
    as Lightning would (:func:`load_trainer_progress`). Copies: torchft serves the state by reference.
    """
    return copy.deepcopy(
        {
            "loops": trainer.fit_loop.state_dict(),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "hyperparameters": [
                [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
                for optimizer in trainer.optimizers
            ],
            "in_step": in_step,
        }
    )


def load_trainer_progress(trainer: Any, state: dict[str, Any], joining: bool) -> None:
    """Takes a peer's :func:`trainer_progress`. The schedulers and hyperparameters are always taken. The loop
    position (global step, epoch, data) only when this group is ``joining`` (its first round, before its first
    batch): the group then goes on from the peer's step as if resumed from a checkpoint the peer saved at the end
    of it, and its training data loaders start at the peer's epoch and skip the batches the peer has read in it
    (each group reads its own part of the data, so these are the batches this group would have read), so that it
    neither replays nor skips data and stops at ``max_steps`` with the others. A group that heals later (its vote
    failed) is at the peers' step already."""
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(scheduler_state)
    for optimizer, groups in zip(trainer.optimizers, state["hyperparameters"], strict=True):
        for group, values in zip(optimizer.param_groups, groups, strict=True):
            group.update(values)
    fit_loop = trainer.fit_loop
    if not joining:
        theirs = _global_step(trainer, state["loops"])
        if theirs != fit_loop.epoch_loop.global_step:
            log.warning(
                "federation group healed from a peer at global step %d while at %d; the data position is kept",
                theirs,
                fit_loop.epoch_loop.global_step,
            )
        return
    fit_loop.load_state_dict(state["loops"])
    epoch_loop = fit_loop.epoch_loop
    if state["in_step"]:  # the end of the peer's step, with Lightning's own bookkeeping
        manual = not trainer.lightning_module.automatic_optimization
        step = (
            epoch_loop.manual_optimization.optim_step_progress
            if manual
            else epoch_loop.automatic_optimization.optim_progress.optimizer.step
        )
        step.increment_completed()
        epoch_loop.batch_progress.increment_processed()
        epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=False)
        if epoch_loop_ready_batches_reached(epoch_loop):
            epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)
    fit_loop.reset()  # restarting from here, as from a checkpoint saved there (load_state_dict marked it)
    batches = epoch_loop.batch_progress.current
    read = batches.processed if state["in_step"] else batches.completed
    if read >= trainer.num_training_batches:
        read = 0  # the peer's step ended its epoch: the reset above moved on to the next
    _start_data_at(trainer, fit_loop.epoch_progress.current.processed, read)


def _global_step(trainer: Any, loops: dict[str, Any]) -> int:
    if trainer.lightning_module.automatic_optimization:
        return loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"]
    return loops["epoch_loop.manual_optimization.optim_step_progress"]["total"]["completed"]


def _start_data_at(trainer: Any, epoch: int, batches: int) -> None:
    """Restarts the training data at ``epoch``, skipping its first ``batches`` batches by sampler index (nothing
    is loaded for them). A loader without a batch sampler (an iterable dataset) starts its stream afresh: its
    position is the dataset's own, which is said."""
    from torch.utils.data import BatchSampler, DataLoader

    combined_loader, data_fetcher = fit_loop_training_data(trainer.fit_loop)
    if combined_loader is None or data_fetcher is None:
        return  # no training data (limit_train_batches=0)
    for loader in combined_loader.flattened:
        _set_sampler_epoch(loader, epoch)
        batch_sampler = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
        if isinstance(batch_sampler, BatchSampler):
            batch_sampler.sampler = _SkipOnce(batch_sampler.sampler, batches * batch_sampler.batch_size)
        elif batches:
            log.warning(
                "federation group joined at batch %d of epoch %d, but its training data %s has no batch sampler to"
                " skip by: it reads from its start, repeating what the group read before",
                batches,
                epoch,
                type(loader).__name__,
            )
    iter(data_fetcher)  # a fresh iterator: the epoch's order, from the position


class _SkipOnce:
    """A sampler whose next pass leaves out its first ``skip`` indices (later passes are whole)."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = (sampler.sampler, skip) if isinstance(sampler, _SkipOnce) else (sampler, skip)

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
