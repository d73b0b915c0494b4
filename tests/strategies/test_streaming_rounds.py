"""Streaming sync under fault tolerance, without processes: each fragment's average is a torchft round of its own
(quorum when sent, vote when due), and a fragment voted down is left as it was while the others are applied."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from lightning_fedshard.strategies.fault_tolerance import (
    ROUNDS_LOGGED,
    FaultTolerance,
    FederationMember,
    _TimedTransport,
)
from lightning_fedshard.strategies.streaming import FragmentSchedule, StreamingSync


@dataclass
class _Pending:
    fragment: int
    average: torch.Tensor
    waited: bool = False


class _Averager:
    """Two groups' fragments: this group's local values and the other group's; the average is their mean."""

    def __init__(self, events: list[tuple]) -> None:
        self.fragments = [[0], [1], [2]]
        self.local = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        self.peer = torch.tensor([3.0, 6.0, 9.0], dtype=torch.float64)
        self.events = events

    def start(self, fragment: int) -> _Pending:
        self.events.append(("send", fragment))
        return _Pending(fragment, (self.local[fragment] + self.peer[fragment]) / 2)

    def complete(self, pending: _Pending) -> None:
        self.events.append(("wait", pending.fragment))
        pending.waited = True

    def finish(self, pending: _Pending, alpha: float = 0.0) -> None:
        assert pending.waited, "applied before the average was waited for"
        self.events.append(("apply", pending.fragment))
        self.local[pending.fragment] = alpha * self.local[pending.fragment] + (1 - alpha) * pending.average


class _Manager:
    """torchft's Manager as the rounds see it: the quorum, and the vote scripted round by round."""

    def __init__(self, events: list[tuple], votes: list[bool]) -> None:
        self.events, self.votes, self.step = events, votes, 0

    def start_quorum(self, timeout: timedelta) -> None:
        self.events.append(("quorum",))

    def num_participants(self) -> int:
        return 2

    def should_commit(self) -> bool:
        vote = self.votes.pop(0)
        self.events.append(("vote", vote))
        self.step += vote
        return vote

    def current_step(self) -> int:
        return self.step


def _member(events: list[tuple], votes: list[bool]) -> FederationMember:
    """A FederationMember over a scripted manager (its constructor would start a real torchft Manager)."""
    member = FederationMember.__new__(FederationMember)
    member.config = FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=2).resolve({})
    member.manager = _Manager(events, votes)
    member.rounds_failed = 0
    member.last_participants = 0
    member.rounds_log, member.track_memory = deque(maxlen=ROUNDS_LOGGED), False
    member.transfers = _TimedTransport(inner=None)  # no checkpoint moves in these scripted rounds
    return member


def test_each_fragment_is_a_round_quorum_when_sent_vote_when_due():
    events: list[tuple] = []
    averager = _Averager(events)
    schedule = FragmentSchedule.create(sync_every=6, fragments=3, delay=1, alpha=0.0, owner="test")
    stream = StreamingSync(averager, schedule, rounds=_member(events, [True, True, True]))
    for step in range(1, 7):
        events.append(("step", step))
        stream.step(step)
    assert events == [
        ("step", 1), ("quorum",), ("send", 0),
        ("step", 2), ("wait", 0), ("vote", True), ("apply", 0),
        ("step", 3), ("quorum",), ("send", 1),
        ("step", 4), ("wait", 1), ("vote", True), ("apply", 1),
        ("step", 5), ("quorum",), ("send", 2),
        ("step", 6), ("wait", 2), ("vote", True), ("apply", 2),
    ]  # fmt: skip
    assert averager.local.tolist() == [2.0, 4.0, 6.0] and stream.fragment_syncs == 3


def test_a_fragment_voted_down_is_left_as_before_and_the_others_are_applied(caplog):
    events: list[tuple] = []
    averager = _Averager(events)
    member = _member(events, [True, False, True])
    schedule = FragmentSchedule.create(sync_every=3, fragments=3, delay=0, alpha=0.5, owner="test")
    stream = StreamingSync(averager, schedule, rounds=member)
    with caplog.at_level(logging.WARNING):
        applied = [stream.step(step) for step in (1, 2, 3)]
    assert applied == [0, None, 2]
    assert averager.local.tolist() == [0.5 * 1 + 0.5 * 2, 2.0, 0.5 * 3 + 0.5 * 6]
    assert stream.fragments_voted_down == 1 and member.rounds_failed == 1
    assert "was not applied" in caplog.text


def test_a_group_healing_from_a_fragment_round_learns_which_fragment_it_joins():
    events: list[tuple] = []
    averager = _Averager(events)
    member = _member(events, [True])
    seen: list[int | None] = []
    schedule = FragmentSchedule.create(sync_every=6, fragments=3, delay=1, alpha=0.0, owner="test")
    stream = StreamingSync(averager, schedule, rounds=member)
    # the state a healing peer fetches is taken inside the quorum: there it names the fragment being sent
    member.manager.start_quorum = lambda timeout: seen.append(stream.sending)
    stream.step(1)
    assert seen == [0] and stream.sending is None and stream.pending.fragment == 0


def test_end_of_fit_under_fault_tolerance_votes_on_the_fragment_in_flight():
    events: list[tuple] = []
    averager = _Averager(events)
    schedule = FragmentSchedule.create(sync_every=6, fragments=3, delay=1, alpha=0.5, owner="test")
    stream = StreamingSync(averager, schedule, rounds=_member(events, [False]))
    stream.step(1)
    with pytest.raises(RuntimeError, match="end_in_flight"):
        stream.close(1)
    assert stream.end_in_flight() is None and stream.pending is None  # voted down: never applied
    assert averager.local.tolist() == [1.0, 2.0, 3.0]
    assert ("apply", 0) not in events
