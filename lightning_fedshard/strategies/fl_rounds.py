"""The cross-group rounds of FL+HSDP: when the groups average (the sync schedule), how (FedAvg or DiLoCo through a
:class:`~lightning_fedshard.strategies.averager.FedAverager`, whole or streamed by fragment), and, under fault
tolerance, how a group joins the federation's rounds and heals from a peer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard.strategies.apply import reshard_all
from lightning_fedshard.strategies.averager import FedAverager, PendingAverage, like_param
from lightning_fedshard.strategies.fault_tolerance import FederationMember, load_trainer_progress, trainer_progress
from lightning_fedshard.strategies.ledger import TIERS, CommLedger
from lightning_fedshard.strategies.streaming import StreamingSync, partition_fragments

__all__ = ["FederatedRounds"]

#: The strategy's counters a healing group takes from its peer, so that it syncs at the same steps.
_ROUND_COUNTERS = ("optimizer_steps", "syncs", "_steps_at_last_sync")


class FederatedRounds:
    """Mixin for :class:`~lightning_fedshard.strategies.FLHSDPStrategy`: the rounds its federation groups run.

    After every optimizer step it asks the strategy's schedule (``options.schedule``) whether a sync is due, and
    then averages the whole model (blocking sync, :meth:`fed_sync`) or sends and applies a fragment's average
    (streaming sync, :meth:`stream_sync`); at train start a fault-tolerant group joins the federation, at train end
    every group ends with the same parameters. It counts ``optimizer_steps`` and ``syncs`` and logs each step's
    traffic. The strategy provides ``options``, ``dims``, ``model``, ``fed_group``, ``device_mesh`` and
    ``_compression``, calls :meth:`_init_rounds` from its ``__init__`` and :meth:`_build_rounds` once its model is
    sharded for fitting.

    Example::

        class FLHSDPStrategy(FederatedRounds, JobEndHooks, ModelParallelStrategy): ...
    """

    def _init_rounds(self) -> None:
        self._member: FederationMember | None = None
        self._joining = False  # the joining round (train start) runs: a heal then takes the peers' position
        self._peer_fragment: int | None = None  # under streaming: the fragment round the group healed from runs
        self._in_step = False  # a round inside an optimizer step, whose end Lightning has not counted yet
        self._averager: FedAverager | None = None
        self._streaming: StreamingSync | None = None
        self.ledger = CommLedger()
        self.optimizer_steps = 0
        self.syncs = 0
        self._steps_at_last_sync = 0

    def _build_rounds(self) -> None:
        """The averager (and streaming sync) over the sharded model, joining the federation under fault tolerance."""
        schedule = self.options.schedule
        named_params = list(self.model.named_parameters())
        fragments = partition_fragments(self.model, named_params, schedule.fragments) if schedule.streaming else None
        if self.fault_tolerance is not None and self._member is None:
            self._member = self._join_federation()
        self._averager = FedAverager(
            named_params,
            fed_group=self.fed_group,
            replicate_group=self.device_mesh.get_group("replicate"),
            ledger=self.ledger,
            outer_optimizer=self.options.outer_optimizer,
            outer_lr=self.options.outer_lr,
            outer_momentum=self.options.outer_momentum,
            sync_dtype=self.options.sync_dtype,
            sync_mode=self.options.sync_mode,
            compression=self._compression("fed"),
            fragments=fragments,
            transport=self._member.transport if self._member else None,
        )
        if schedule.streaming:
            self._streaming = StreamingSync(self._averager, schedule, rounds=self._member)
            if self._compression("fed") is not None and schedule.delay:
                rank_zero_warn(
                    f"{type(self).__name__}: DynamiQ's compressed ring runs in the training thread, so each"
                    " fragment's average is computed when it is sent: staggered, but not overlapping compute."
                )

    # ---- fault tolerance: membership and healing ----------------------------------------------------

    def _join_federation(self) -> FederationMember:
        """This rank's torchft Manager; the first round (:meth:`on_train_start`) heals the group from the others."""
        assert self.model is not None and self.fault_tolerance is not None
        return FederationMember(
            self.fault_tolerance.resolve(),
            rank=self.global_rank,
            world_size=self.world_size,
            params=list(self.model.named_parameters()),
            outer_state=lambda: self._averager.state_dict() if self._averager else {},
            load_outer_state=lambda state: self._averager.load_state_dict(state) if self._averager else None,
            progress=self._federation_progress,
            load_progress=self._load_federation_progress,
            backend=self._process_group_backend or "gloo",
        )

    def _federation_progress(self) -> dict[str, Any]:
        progress: dict[str, Any] = {key: getattr(self, key) for key in _ROUND_COUNTERS}
        progress["trainer"] = trainer_progress(self.lightning_module.trainer, self._in_step)
        progress["round_fragment"] = None if self._streaming is None else self._streaming.sending
        return progress

    def _load_federation_progress(self, progress: dict[str, Any]) -> None:
        for key in _ROUND_COUNTERS:
            setattr(self, key, progress[key])
        load_trainer_progress(self.lightning_module.trainer, progress["trainer"], joining=self._joining)
        self._peer_fragment = progress.get("round_fragment")

    # ---- rounds -------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.optimizer_steps += 1
        schedule = self.options.schedule
        if schedule.due(self.optimizer_steps):
            self._in_step = True  # a group healing from this one's round resumes after this step
            try:
                self.stream_sync() if schedule.streaming else self.fed_sync()
            finally:
                self._in_step = False
        self._log_communication()
        return output

    def stream_sync(self) -> None:
        """Streaming sync after an optimizer step the schedule is due at: sends the fragment average due now,
        applies the one due now."""
        fed = self.dims.fed_enabled or self._member is not None  # under fault tolerance a job is one group
        if not fed or self._streaming is None:
            return
        reshard_all(self.model)
        if self._streaming.step(self.optimizer_steps) == self.options.schedule.fragments - 1:
            self._synced()  # a round: every fragment averaged once

    def fed_sync(self) -> None:
        """One cross-group round: reshard every FSDP unit, then average the local shards across groups."""
        if not (self.dims.fed_enabled or self._member) or self._averager is None:
            return
        reshard_all(self.model)
        if self._member is None:
            self._averager.sync()
        elif not self._member.run_round(self._average, self._apply_average):
            return
        self._synced()

    def _synced(self) -> None:
        self.syncs += 1
        self._steps_at_last_sync = self.optimizer_steps

    def _average(self) -> list[PendingAverage]:
        """The round's averages, waited for, in buffers of their own: the model and the outer state are untouched
        until :meth:`_apply_average`, so a round the group votes down needs nothing restored."""
        assert self._averager is not None
        pending = [self._averager.start(fragment) for fragment in range(len(self._averager.fragments))]
        for average in pending:
            self._averager.complete(average)
        return pending

    def _apply_average(self, pending: list[PendingAverage]) -> None:
        assert self._averager is not None
        for average in pending:
            self._averager.finish(average)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._member is not None:
            # join: a group that starts late or restarts takes the federation's current state and position
            self._joining = True
            try:
                if self._streaming is None:
                    self.fed_sync()
                else:
                    self._join_stream()
            finally:
                self._joining = False

    def _join_stream(self) -> None:
        """The joining round under streaming sync: the quorum heals a late or restarted group from a peer, which
        is then either in the whole-model round every group runs at train start, or at one fragment's send point
        (nothing in flight there), whose round this group joins; it then follows the schedule from the peers'
        step. A group that did not heal runs the whole-model round with the others."""
        assert self._member is not None and self._streaming is not None and self._averager is not None
        reshard_all(self.model)
        self._peer_fragment = None
        started = self._member.start_round(
            lambda: self._average() if self._peer_fragment is None else self._averager.start(self._peer_fragment)
        )
        if isinstance(started, PendingAverage):
            self._streaming.pending = started
            if self._streaming.apply_due(self.optimizer_steps) == self.options.schedule.fragments - 1:
                self._synced()
        elif self._member.end_round(started, self._apply_average):
            self._synced()

    @override
    def on_train_end(self) -> None:
        # The fitted model is the federation's consensus, even when the run stops between syncs.
        if self._streaming is not None and self._member is not None:
            # under fault tolerance: the fragment in flight ends its round, then one whole-model round, so every
            # group present ends equal whichever fragment rounds it failed
            reshard_all(self.model)
            self._streaming.end_in_flight()
            self.fed_sync()
        elif self._streaming is not None and self.dims.fed_enabled:
            reshard_all(self.model)
            if self._streaming.close(self.optimizer_steps):
                self._synced()
        elif self.optimizer_steps > self._steps_at_last_sync:
            self.fed_sync()
        reshard_all(self.model)  # a last validation may have left root units gathered: hand back shards
        super().on_train_end()

    def _log_communication(self) -> None:
        step_bytes = self.ledger.close_step()
        metrics = {f"comm/{tier}_bytes": step_bytes[tier] for tier in TIERS}
        metrics["fed/syncs"] = float(self.syncs)
        if self._streaming is not None:
            for fragment in range(self._streaming.schedule.fragments):
                metrics[f"comm/fed_fragment{fragment}_bytes"] = self.ledger.last_fragment_step.get(fragment, 0.0)
        if self._member is not None:
            metrics["fed/groups"] = float(self._member.last_participants)
        if self._averager is not None:
            metrics.update(self._averager.stats.take_metrics("dynamiq/fed"))
        assert self.lightning_module is not None
        self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    # ---- checkpoints: what the rounds save and restore beside the model and optimizers --------------

    def _round_state(self) -> dict[str, Any]:
        """The outer optimizer's state and the average in flight (completed now: what the groups averaged is
        saved, and applied when due), one DTensor per parameter, sharded like it."""
        state: dict[str, Any] = {}
        if self._averager is not None:
            state["outer"] = self._averager.state_dict()
        if (pending := self._pending_average()) is not None:
            self._averager.complete(pending)
            state["in_flight"] = self._in_flight_state(pending)
        return state

    def _round_meta(self) -> dict[str, Any]:
        """The round counters and membership a checkpoint's manifest records."""
        return {
            "optimizer_steps": self.optimizer_steps,
            "steps_at_last_sync": self._steps_at_last_sync,
            "syncs": self.syncs,
            "in_flight_fragment": None if (pending := self._pending_average()) is None else pending.fragment,
            "torchft": self._member.state_dict() if self._member else None,
        }

    def _pending_average(self) -> PendingAverage | None:
        return None if self._streaming is None else self._streaming.pending

    def _in_flight_state(self, pending: PendingAverage) -> dict[str, Any]:
        """The in-flight fragment's average, one DTensor per parameter, sharded like it."""
        assert self._averager is not None
        params = [self._averager.named_params[i] for i in pending.indices]
        averaged = pending.unflatten([p.to_local() for _, p in params])
        return {name: like_param(p, avg) for (name, p), avg in zip(params, averaged, strict=True)}

    def _round_state_to_load(self, saved: dict[str, Any], path: Path) -> tuple[dict[str, Any], PendingAverage | None]:
        """What :meth:`_load_round_state` loads into (the entries of :meth:`_round_state`), and the average in flight
        to restore, from the manifest ``saved``."""
        state: dict[str, Any] = {}
        if self._averager is not None:
            state["outer"] = self._averager.state_dict()
        in_flight = saved.get("in_flight_fragment")
        if in_flight is not None and self._member is not None:
            rank_zero_warn(
                f"The checkpoint {str(path)!r} was saved with fragment {in_flight}'s average in flight; under fault"
                " tolerance that average was never voted on, so it is dropped: the fragment keeps the checkpoint's"
                " local shards and is averaged again at its next round."
            )
            in_flight = None
        if in_flight is None:
            return state, None
        if self._streaming is None:
            raise ValueError(
                f"The checkpoint {str(path)!r} was saved under streaming sync with fragment {in_flight}'s average"
                " in flight; resume it with the same sync_schedule='streaming' settings."
            )
        template = PendingAverage(in_flight, self._averager.fragments[in_flight])
        template.buckets.append(
            (list(range(len(template.indices))), self._averager.empty_buffer(template.indices), None)
        )
        state["in_flight"] = self._in_flight_state(template)
        return state, template

    def _load_round_state(self, state: dict[str, Any], saved: dict[str, Any], in_flight: PendingAverage | None) -> None:
        if self._averager is not None:
            self._averager.load_state_dict(state["outer"])
        self.optimizer_steps = saved["optimizer_steps"]
        self._steps_at_last_sync = saved["steps_at_last_sync"]
        self.syncs = saved["syncs"]
        if in_flight is not None:
            assert self._streaming is not None
            params = [self._averager.named_params[i] for i in in_flight.indices]
            for (name, p), view in zip(params, in_flight.unflatten([p.to_local() for _, p in params]), strict=True):
                view.copy_(state["in_flight"][name].to_local())
            in_flight.complete = True
            self._streaming.pending = in_flight
        if self._member is not None and saved.get("torchft"):
            self._member.load_state_dict(saved["torchft"])
