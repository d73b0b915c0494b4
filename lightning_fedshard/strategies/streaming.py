"""Streaming sync (streaming DiLoCo): the model in fragments whose cross-group averages overlap training.

Instead of averaging the whole model every ``sync_every`` steps and waiting for it, the model is split into
``fragments`` groups of consecutive FSDP units, balanced by size. Every ``sync_every / fragments`` steps one
fragment's average is due: it is sent ``fragment_sync_delay`` (τ) steps before it is due, without waiting, so
the cross-group traffic crosses the slow link while the next τ steps compute; when due it is waited for, applied
(FedAvg or the DiLoCo outer step) and mixed into the local shards by ``fragment_update_alpha``. Each fragment is
averaged once per round of ``sync_every`` steps, and one fragment's bytes cross at a time, so the peak bandwidth
falls by the number of fragments. The schedule is torchft's (``torchft.local_sgd.DiLoCo``): the k-th fragment
sync is due at step ``k · sync_every / fragments`` and averages fragment ``(k - 1) % fragments``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_fedshard.strategies.averager import FedAverager, PendingAverage

if TYPE_CHECKING:
    from lightning_fedshard.strategies.fault_tolerance import FederationMember

__all__ = ["SYNC_SCHEDULES", "FragmentSchedule", "StreamingSync", "partition_fragments"]

SYNC_SCHEDULES = ("blocking", "streaming")


@dataclass(frozen=True)
class FragmentSchedule:
    """When the groups sync, by optimizer step (counted from 1): the one place ``sync_every`` is kept.

    Under streaming sync each fragment's average is sent ``delay`` steps before it is due and applied when due.
    Blocking sync is the schedule of one fragment, the whole model, sent and applied at the same step while
    training waits: it is due every ``sync_every`` steps.

    Example::

        schedule = FragmentSchedule.create(sync_every=8, fragments=4, delay=1, alpha=0.5, owner="FLFSDPStrategy")
        schedule.starting(1), schedule.finishing(2)  # (0, 0): fragment 0 is sent after step 1, applied after step 2
        FragmentSchedule.blocking(8).due(16)  # True: the whole model is averaged after step 16
    """

    sync_every: int
    fragments: int
    delay: int
    """τ: optimizer steps between sending a fragment's average and applying it."""
    alpha: float
    """Weight of the local shards when the average is applied (0: adopt the global copy)."""
    streaming: bool = True
    """Whether the fragments' averages overlap training (else the whole model is averaged while training waits)."""

    @classmethod
    def blocking(cls, sync_every: int) -> FragmentSchedule:
        return cls(sync_every, fragments=1, delay=0, alpha=0.0, streaming=False)

    @classmethod
    def choose(
        cls, sync_schedule: str, *, sync_every: int, fragments: int, delay: int, alpha: float, owner: str
    ) -> FragmentSchedule:
        """The ``sync_schedule`` (one of :data:`SYNC_SCHEDULES`) with its settings, checked; blocking sync takes no
        fragment settings."""
        if sync_schedule not in SYNC_SCHEDULES:
            raise ValueError(f"{owner}: unknown `sync_schedule={sync_schedule!r}`; choose one of {SYNC_SCHEDULES}.")
        if sync_schedule == "streaming":
            return cls.create(sync_every=sync_every, fragments=fragments, delay=delay, alpha=alpha, owner=owner)
        if (fragments, delay, alpha) != (1, 0, 0):
            raise ValueError(
                f"{owner}: `fragments`, `fragment_sync_delay` and `fragment_update_alpha` apply to"
                f" sync_schedule='streaming'; got fragments={fragments!r}, fragment_sync_delay={delay!r},"
                f" fragment_update_alpha={alpha!r} with sync_schedule='blocking'."
            )
        return cls.blocking(sync_every)

    @classmethod
    def create(cls, *, sync_every: int, fragments: int, delay: int, alpha: float, owner: str) -> FragmentSchedule:
        """A streaming schedule: validates the settings by torchft's rules and names the one that is wrong."""
        if not _is_int(fragments) or fragments < 1:
            raise ValueError(f"{owner}: `fragments` must be an integer ≥ 1, got {fragments!r}.")
        if sync_every % fragments:
            raise ValueError(
                f"{owner}: `sync_every={sync_every}` must be divisible by `fragments={fragments}`: each fragment"
                " is averaged once per round of sync_every steps, one every sync_every / fragments steps."
            )
        interval = sync_every // fragments
        if not _is_int(delay) or not 0 <= delay < interval:
            raise ValueError(
                f"{owner}: `fragment_sync_delay` must be an integer in [0, sync_every // fragments) = [0, {interval}),"
                f" got {delay!r}: a fragment's average must be applied before the next one is sent."
            )
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
            raise ValueError(f"{owner}: `fragment_update_alpha` must be a number in [0, 1], got {alpha!r}.")
        return cls(sync_every, fragments, delay, float(alpha))

    def due(self, step: int) -> bool:
        """Whether anything is sent or applied after optimizer step ``step``."""
        return self.starting(step) is not None or self.finishing(step) is not None

    @property
    def interval(self) -> int:
        """Optimizer steps between two fragment syncs."""
        return self.sync_every // self.fragments

    def starting(self, step: int) -> int | None:
        """The fragment whose average is sent after optimizer step ``step``, if any."""
        due = step + self.delay
        return (due // self.interval - 1) % self.fragments if due % self.interval == 0 else None

    def finishing(self, step: int) -> int | None:
        """The fragment whose average is applied after optimizer step ``step``, if any."""
        return (step // self.interval - 1) % self.fragments if step % self.interval == 0 else None


def partition_fragments(
    module: nn.Module,
    named_params: Sequence[tuple[str, nn.Parameter]],
    fragments: int,
    units: Sequence[nn.Module] | None = None,
) -> list[list[int]]:
    """Splits ``named_params`` (in module order) into ``fragments`` runs of consecutive FSDP units, balanced by size.

    A parameter belongs to the innermost FSDP unit around it; a root unit's parameters before and after its inner
    units (a Llama's embeddings, final norm and head) are separate pieces, so they join the blocks next to them.
    The pieces are cut into ``fragments`` consecutive runs so that the largest run is as small as possible.
    Returns indices into ``named_params``; the same on every rank, since it depends on names and global shapes only.
    ``units`` are the FSDP units (default: the ``fully_shard`` modules of ``module``; the cost model passes the
    units :func:`~lightning_fedshard.strategies.apply.fsdp_units` would shard, for a model not sharded yet).

    Example::

        partition_fragments(model, list(model.named_parameters()), 4)  # [[0, 1, ...], [...], [...], [...]]
    """
    unit_ids = {id(m) for m in units} if units is not None else None
    prefixes = sorted(
        (
            name + "." if name else ""
            for name, m in module.named_modules()
            if (id(m) in unit_ids if unit_ids is not None else isinstance(m, FSDPModule))
        ),
        key=len,
        reverse=True,
    )
    pieces: list[list[int]] = []
    last_unit: str | None = None
    for i, (name, _) in enumerate(named_params):
        unit = next((prefix for prefix in prefixes if name.startswith(prefix)), "")
        if unit != last_unit:
            pieces.append([])
            last_unit = unit
        pieces[-1].append(i)
    if fragments > len(pieces):
        raise ValueError(
            f"streaming sync: `fragments={fragments}` exceeds the model's {len(pieces)} pieces (consecutive FSDP units"
            " and the root's parameters around them); a fragment holds at least one. Shard more blocks (auto_wrap)"
            " or use fewer fragments."
        )
    sizes = [sum(named_params[i][1].numel() for i in piece) for piece in pieces]
    return [[i for piece in pieces[a:b] for i in piece] for a, b in _balanced_cuts(sizes, fragments)]


def _balanced_cuts(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive, non-empty ranges of ``sizes`` whose largest sum is the smallest possible."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest sum cutting sizes[:i] into k ranges; cut[k][i]: where the last range starts
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, end = [], n
    for k in range(parts, 0, -1):
        ranges.append((cut[k][end], end))
        end = cut[k][end]
    return ranges[::-1]


class StreamingSync:
    """Runs a :class:`FragmentSchedule` on a :class:`FedAverager`: sends and applies fragments' averages as the
    optimizer steps go by, keeping the one in flight.

    With ``rounds`` (a :class:`~lightning_fedshard.strategies.fault_tolerance.FederationMember`), each fragment's
    average is a torchft round of its own: the quorum when it is sent, the vote when it is due; a fragment voted
    down is left as it was before the round, and the other fragments are untouched.

    Example::

        stream = StreamingSync(averager, schedule)  # or StreamingSync(averager, schedule, rounds=member)
        stream.step(strategy.optimizer_steps)  # after every optimizer step, FSDP modules resharded
        stream.close(strategy.optimizer_steps)  # at the end of fit: every group holds the same parameters
    """

    def __init__(
        self, averager: FedAverager, schedule: FragmentSchedule, rounds: FederationMember | None = None
    ) -> None:
        if len(averager.fragments) != schedule.fragments:
            raise ValueError(
                f"the averager has {len(averager.fragments)} fragments, the schedule {schedule.fragments}."
            )
        self.averager = averager
        self.schedule = schedule
        self.rounds = rounds
        self.pending: PendingAverage | None = None
        self.sending: int | None = None
        """The fragment whose round's quorum runs now (what a group healing from this one joins), else None."""
        self.fragment_syncs = 0
        self.fragments_voted_down = 0
        self._agreed_at: dict[int, int] = {}
        """Fragments whose local shards equal their global copy, by the step at which they were applied."""

    def step(self, step: int) -> int | None:
        """Sends and applies what is due after optimizer step ``step``; returns the fragment applied, if any."""
        if (fragment := self.schedule.starting(step)) is not None:
            self.send(fragment, step)
        return self.apply_due(step)

    def send(self, fragment: int, step: int) -> None:
        """Sends ``fragment``'s average (in its own round's quorum under fault tolerance) without waiting."""
        if self.pending is not None:
            raise RuntimeError(f"streaming sync: fragment {self.pending.fragment} is still in flight at step {step}.")
        if self.rounds is None:
            self.pending = self.averager.start(fragment)
            return
        self.sending = fragment
        try:
            self.pending = self.rounds.start_round(lambda: self.averager.start(fragment))
        finally:
            self.sending = None

    def apply_due(self, step: int) -> int | None:
        """Applies the fragment due after optimizer step ``step`` (under fault tolerance: if its round's vote
        passes); returns it, or None when none is due or the vote failed."""
        if (fragment := self.schedule.finishing(step)) is None:
            return None
        if self.pending is None or self.pending.fragment != fragment:
            raise RuntimeError(f"streaming sync: fragment {fragment} is due at step {step} but was never sent.")
        pending, self.pending = self.pending, None
        if self.rounds is None:
            self.averager.finish(pending, self.schedule.alpha)
        elif not self.rounds.end_round(
            pending, lambda p: self.averager.finish(p, self.schedule.alpha), wait=self.averager.complete
        ):
            self.fragments_voted_down += 1
            self._agreed_at.pop(fragment, None)
            return None
        self.fragment_syncs += 1
        if self.schedule.delay == 0 and self.schedule.alpha == 0:
            self._agreed_at[fragment] = step
        return fragment

    def close(self, step: int) -> list[int]:
        """Ends streaming at optimizer step ``step`` with every group holding the same parameters: the fragment in
        flight is applied without mixing (alpha 0), and every fragment whose local shards moved since it was last
        applied is averaged at once. Returns the fragments averaged here.

        Under fault tolerance the fragment in flight ends its round (its vote), and the caller then runs one
        whole-model round instead (:meth:`end_in_flight`), since which fragments agree differs between groups that
        failed rounds and groups that did not."""
        if self.rounds is not None:
            raise RuntimeError(
                "streaming sync under fault tolerance ends with end_in_flight() and a whole-model round."
            )
        closed = []
        if self.pending is not None:
            self.averager.finish(self.pending)
            closed.append(self.pending.fragment)
            self._agreed_at[self.pending.fragment] = step
            self.pending = None
        for fragment in range(self.schedule.fragments):
            if self._agreed_at.get(fragment) != step:
                self.averager.finish(self.averager.start(fragment))
                self._agreed_at[fragment] = step
                closed.append(fragment)
        self.fragment_syncs += len(closed)
        return closed

    def end_in_flight(self) -> int | None:
        """Under fault tolerance, at the end of fit: the fragment in flight ends its round now (waited for, voted
        on, applied without mixing if the vote passes). Returns it if it was applied."""
        if self.rounds is None or self.pending is None:
            return None
        pending, self.pending = self.pending, None
        if not self.rounds.end_round(pending, self.averager.finish, wait=self.averager.complete):
            self.fragments_voted_down += 1
            return None
        self.fragment_syncs += 1
        return pending.fragment


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
