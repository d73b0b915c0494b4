"""FL+HSDP: federation groups that train with HSDP and average their parameter shards every few steps."""

from __future__ import annotations

import importlib
import math
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard.compat import _PATH, _optimizers_to_device
from lightning_fedshard.distributed import JobEndHooks, check_timeout, destroy_process_group_at_exit
from lightning_fedshard.dynamiq.fsdp import DynamiQReduceScatter, install_dynamiq_reduce_scatter
from lightning_fedshard.dynamiq.plugin import DynamiQ
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.optim.shard_plan import BlockShardPlan
from lightning_fedshard.strategies.apply import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    broadcast_initial_state,
    check_fully_sharded,
    is_sharded,
    materialize,
    reshard_all,
)
from lightning_fedshard.strategies.averager import OUTER_OPTIMIZERS, SYNC_MODES, FedAverager, PendingAverage, like_param
from lightning_fedshard.strategies.dims import FedShardDims
from lightning_fedshard.strategies.fault_tolerance import (
    FaultTolerance,
    FederationMember,
    load_trainer_progress,
    trainer_progress,
)
from lightning_fedshard.strategies.group_checkpoint import (
    FEDSHARD_KEY,
    FILES_KEY,
    describe_group_share,
    finish_save,
    load_group_state,
    load_meta,
    save_group_state,
    staging_dir,
    verify_group_files,
)
from lightning_fedshard.strategies.ledger import TIERS, CommLedger, install_fsdp_counters
from lightning_fedshard.strategies.streaming import SYNC_SCHEDULES, FragmentSchedule, StreamingSync, partition_fragments

__all__ = ["FLHSDPStrategy"]


class FLHSDPStrategy(JobEndHooks, ModelParallelStrategy):
    """Federated learning over HSDP groups on one ``("fed", "replicate", "shard")`` device mesh.

    The world is split into ``num_groups`` federation groups of contiguous ranks. Each group trains its
    own model copy with FSDP2 over ``replicate_size × shard_size`` ranks on its own data; every
    ``sync_every`` optimizer steps the groups average their parameter shards (FedAvg) or step a
    DiLoCo outer optimizer. ``num_groups=1`` is plain HSDP (registered as ``"hsdp"``).

    Arguments:
        num_groups: Federation groups F. ``None`` derives it from the world (at least 2).
        shard_size: Ranks a parameter is sharded over (S). ``None`` derives it: the most devices of one node
            that leave room for the other dimensions.
        replicate_size: HSDP replicas per group (R ≥ 2). ``None`` derives it (the fewest, at least 2).
            Sizes that are given are kept as given; the layout chosen for the others is logged (see
            :meth:`layout`): on one node of 4 devices 2 groups × 2 replicas × 1 shard, of 8 2 × 2 × 2.
        sync_every: Optimizer steps between cross-group syncs (H). With gradient accumulation one
            accumulation window is one step.
        outer_optimizer: ``"avg"`` (FedAvg, as in the FL+FSDP paper) or ``"nesterov"`` (DiLoCo: SGD with
            Nesterov momentum on the pseudo-gradient ``global - local``).
        outer_lr, outer_momentum: The DiLoCo outer step's learning rate and momentum.
        sync_dtype: dtype of the cross-group average (``"float32"`` averages bf16 shards in fp32).
        sync_mode: ``"all_replicas"`` (every replica joins the cross-group all-reduce, as in the paper) or
            ``"leader"`` (replica 0 all-reduces across groups, then broadcasts inside its group).
        sync_schedule: ``"blocking"`` (every ``sync_every`` steps the whole model is averaged while training waits)
            or ``"streaming"`` (streaming DiLoCo, :mod:`~lightning_fedshard.strategies.streaming`: the model in
            ``fragments`` whose averages are sent in turn, one every ``sync_every / fragments`` steps, and applied
            ``fragment_sync_delay`` steps after they were sent, so the traffic overlaps those steps' compute).
        fragments: Fragments of the model under streaming sync: runs of consecutive FSDP units balanced by size;
            ``sync_every`` must be divisible by it.
        fragment_sync_delay: τ, optimizer steps between sending a fragment's average and applying it, in
            ``[0, sync_every // fragments)``. With DynamiQ on the cross-group traffic the compressed ring runs in
            the training thread when sent, so it is staggered but does not overlap compute.
        fragment_update_alpha: Weight in [0, 1] of the local shards when a fragment's average is applied
            (``alpha · local + (1 - alpha) · global``); 0 adopts the global copy. Streaming with one fragment,
            τ = 0 and alpha = 0 is the blocking sync exactly.
        auto_wrap: Module classes (or their import paths) to shard one FSDP unit per instance when the
            LightningModule's ``configure_model`` does not call ``fully_shard`` itself.
        activation_checkpointing: Module classes (or import paths) whose activations are recomputed in the
            backward pass instead of stored (applied before ``auto_wrap`` sharding).
        compile: Module classes (or import paths) whose ``forward`` is compiled with ``torch.compile``, one instance
            at a time (:func:`~lightning_fedshard.strategies.apply.apply_compile`, after activation checkpointing and
            before sharding, as torchtitan does), e.g. ``["lightning_fedshard.models.TransformerBlock"]``. The first
            steps pay the compilation; the blocks of one model share its graphs.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (``None``: the device's default).
        shard_block: Block-aligned shards (:class:`~lightning_fedshard.optim.BlockShardPlan`): each parameter is sharded on
            the dimension whose shards start on multiples of ``shard_block`` coordinates (256 for DynamiQ, 32 or 128
            for :class:`~lightning_fedshard.optim.AdamW8bit`'s blocks), the plan and its padding logged, and the
            parameters FSDP2 cannot align named. ``None``: FSDP2's dim 0 for every parameter.
        timeout: How long a collective of any of the run's process groups (the world, ``fed``, ``replicate``,
            ``shard`` and the per-group checkpoint groups) waits for the other ranks before it fails. A rank that
            fails takes the others on its machine with it (a stopped one too), so every rank exits non-zero; a
            SIGTERM stop exits with status 143 (:class:`~lightning_fedshard.distributed.JobEnd`).
        fault_tolerance: Off by default. A :class:`~lightning_fedshard.strategies.fault_tolerance.FaultTolerance`
            makes this job one federation group (``num_groups`` 1 or ``None``) that averages with the other groups'
            jobs through torchft: a group that dies is left out, one that restarts heals from a live peer and goes
            on from its step, learning rate and data position (docs/fault_tolerance.md). Each group reads its own
            part of the data, the samples it would read as group ``group_id`` of one job of ``num_groups``.

    With ``precision="bf16-mixed"`` the FSDP2 units gather parameters in bf16 and reduce gradients in fp32
    (``MixedPrecisionPolicy``); the sharded parameters and the optimizer stay in fp32. A model built on the
    meta device is materialised shard by shard, calling each module's ``reset_parameters()``.

    ``LightningModule.device_mesh`` is the mesh of one model copy (``("replicate", "shard")``), so a
    ``configure_model`` that calls ``fully_shard(block, mesh=self.device_mesh)`` shards inside its group.

    Example::

        import lightning_fedshard  # registers "fl_fsdp", "fl_hsdp", "fsdp2", "hsdp"
        trainer = Trainer(accelerator="cpu", devices=8,
                          strategy=FLHSDPStrategy(num_groups=2, replicate_size=2, shard_size=2, sync_every=4))
    """

    _min_replicate_size = 2

    def __init__(
        self,
        num_groups: int | None = None,
        shard_size: int | None = None,
        replicate_size: int | None = None,
        sync_every: int = 8,
        outer_optimizer: Literal["avg", "nesterov"] = "avg",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_dtype: str | torch.dtype = "float32",
        sync_mode: Literal["all_replicas", "leader"] = "all_replicas",
        sync_schedule: Literal["blocking", "streaming"] = "blocking",
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        auto_wrap: Sequence[str | type[nn.Module]] | None = None,
        activation_checkpointing: Sequence[str | type[nn.Module]] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        shard_block: int | None = None,
        fault_tolerance: FaultTolerance | None = None,
        compile: Sequence[str | type[nn.Module]] | None = None,
    ) -> None:
        name = type(self).__name__
        super().__init__(
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=check_timeout(timeout, name),
        )
        if not _is_int(sync_every) or sync_every < 1:
            raise ValueError(
                f"{name}: `sync_every` must be an integer ≥ 1 (optimizer steps between syncs), got {sync_every!r}."
            )
        if outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"{name}: unknown `outer_optimizer={outer_optimizer!r}`; choose one of {OUTER_OPTIMIZERS}."
            )
        if not _is_real(outer_lr) or not 0 < outer_lr < math.inf:
            raise ValueError(f"{name}: `outer_lr` must be a finite number > 0, got {outer_lr!r}.")
        if not _is_real(outer_momentum) or not 0 <= outer_momentum < 1:
            raise ValueError(f"{name}: `outer_momentum` must be a number in [0, 1), got {outer_momentum!r}.")
        if sync_mode not in SYNC_MODES:
            raise ValueError(f"{name}: unknown `sync_mode={sync_mode!r}`; choose one of {SYNC_MODES}.")
        self._schedule = _fragment_schedule(
            sync_schedule, sync_every, fragments, fragment_sync_delay, fragment_update_alpha, name
        )
        for arg, value in (("num_groups", num_groups), ("shard_size", shard_size)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}: `{arg}` must be a positive integer or None, got {value!r}.")
        if replicate_size is not None:
            self._check_replicate_size(replicate_size)
        if shard_block is not None and (not _is_int(shard_block) or shard_block < 1):
            raise ValueError(f"{name}: `shard_block` must be a positive integer or None, got {shard_block!r}.")
        self.shard_block = shard_block
        if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(f"{name}: `fault_tolerance` must be a FaultTolerance or None, got {fault_tolerance!r}.")
        if fault_tolerance is not None and num_groups not in (None, 1):
            raise ValueError(
                f"{name}: with `fault_tolerance` each federation group is a job of its own, so `num_groups` (groups"
                f" inside this job's world) must be 1 or None, got {num_groups!r}; start one job per group."
            )
        self.fault_tolerance = fault_tolerance
        self._member: FederationMember | None = None
        self._joining = False  # the joining round (train start) runs: a heal then takes the peers' position
        self._peer_fragment: int | None = None  # under streaming: the fragment round the group healed from runs
        self._in_step = False  # a round inside an optimizer step, whose end Lightning has not counted yet
        self._num_groups = num_groups
        self._shard_size = shard_size
        self._replicate_size = replicate_size
        self.sync_every = sync_every
        self.outer_optimizer = outer_optimizer
        self._outer_lr = float(outer_lr)
        self._outer_momentum = float(outer_momentum)
        self._sync_dtype = _resolve_dtype(sync_dtype, name)
        self.sync_mode = sync_mode
        self._auto_wrap = _resolve_classes(auto_wrap, "auto_wrap", name)
        self._activation_checkpointing = _resolve_classes(activation_checkpointing, "activation_checkpointing", name)
        self._compile = _resolve_classes(compile, "compile", name)
        self._dims: FedShardDims | None = None
        self._group_pg: dist.ProcessGroup | None = None
        self._averager: FedAverager | None = None
        self._streaming: StreamingSync | None = None
        self.ledger = CommLedger()
        self.optimizer_steps = 0
        self.syncs = 0
        self._steps_at_last_sync = 0

    # ---- layout -------------------------------------------------------------------------------------

    @property
    def dims(self) -> FedShardDims:
        if self._dims is None:
            raise RuntimeError(f"{type(self).__name__}.dims is known only once the Trainer has set up its devices.")
        return self._dims

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh one model copy is sharded over: ``("replicate", "shard")``, or ``("shard",)`` when R = 1."""
        return FedShardDims.fsdp_mesh(self.device_mesh)

    @property
    def fed_group(self) -> dist.ProcessGroup:
        """Ranks holding the same (replicate, shard) slice in every group; the FedAvg all-reduce runs here."""
        return self.device_mesh.get_group("fed")

    @property
    def group_index(self) -> int:
        return self.device_mesh.get_local_rank("fed")

    def _check_replicate_size(self, replicate_size: int) -> None:
        if not _is_int(replicate_size) or replicate_size < self._min_replicate_size:
            raise ValueError(
                f"{type(self).__name__}: `replicate_size` must be an integer ≥ {self._min_replicate_size}, got"
                f" {replicate_size!r}. FL+HSDP needs at least two replicas per group; use FLFSDPStrategy"
                " (strategy='fl_fsdp') for groups without replication."
            )

    def layout(self, num_nodes: int, devices: int) -> FedShardDims:
        """The mesh this strategy uses on ``num_nodes`` nodes of ``devices`` processes each.

        Sizes given to the constructor are kept; the others are derived so that the layout has every
        dimension the strategy promises (FL: at least two groups; HSDP: at least two replicas), sharding over
        as many devices of one node as are left (see :meth:`FedShardDims.resolve`). Example::

            FLHSDPStrategy().layout(num_nodes=1, devices=8)  # FedShardDims(num_groups=2, replicate_size=2, shard_size=2)
        """
        try:
            dims = FedShardDims.resolve(
                num_nodes * devices,
                devices,
                num_groups=self._num_groups,
                replicate_size=self._replicate_size,
                shard_size=self._shard_size,
                min_groups=1 if self.fault_tolerance else 2,
                min_replicas=self._min_replicate_size,
            )
        except ValueError as error:
            hint = (
                " FL+HSDP needs at least two replicas per group; FLFSDPStrategy (strategy='fl_fsdp') has groups"
                " without replication."
                if self._min_replicate_size > 1
                else ""
            )
            raise ValueError(
                f"{type(self).__name__} on {num_nodes} node(s) × {devices} device(s): {error}{hint}"
            ) from None
        return dims

    def _resolve_dims(self) -> FedShardDims:
        return self.layout(self.num_nodes, self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this once devices and nodes are known and before any process starts: the
        # earliest point at which a mesh that cannot fit the world can be rejected.
        self._dims = self._resolve_dims()
        if self.fault_tolerance is not None:
            self.fault_tolerance = self.fault_tolerance.resolve()  # a missing address fails before any process starts
        if None in (self._num_groups, self._replicate_size, self._shard_size):
            rank_zero_info(
                f"{type(self).__name__}: {self._dims.describe()} over {self.num_nodes} node(s) × {self.num_processes}"
                " device(s), derived from the world; pass num_groups, replicate_size and shard_size to choose."
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._dims = self._resolve_dims()
        self._device_mesh = self._dims.build_mesh(self.root_device.type, self._timeout)
        self._group_pg = self._build_group_process_group()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.fsdp_mesh

    def _build_group_process_group(self) -> dist.ProcessGroup | None:
        dims = self.dims
        if not dims.fed_enabled:
            return None  # the default (world) group
        ranks = [list(range(g * dims.group_size, (g + 1) * dims.group_size)) for g in range(dims.num_groups)]
        group, _ = dist.new_subgroups_by_enumeration(ranks, timeout=self._timeout)
        return group

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of every group reads different samples. Under fault tolerance this job is one group of
        # the federation: its ranks take the parts that one job of all the groups would give this group's ranks.
        if self.fault_tolerance is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}  # the groups are contiguous ranks
        group, groups = self.federation_group
        return {"num_replicas": groups * self.world_size, "rank": group * self.world_size + self.global_rank}

    @property
    def federation_group(self) -> tuple[int, int]:
        """``(group id, number of groups)`` of the federation this rank trains in, the same with or without fault
        tolerance (then from its :class:`FaultTolerance` config, which the torchft Manager's membership is
        checked against at every round). An iterable dataset that cannot be split by rank can seed its
        stream with the group id so that the groups read different data."""
        if self.fault_tolerance is not None:
            ft = self.fault_tolerance.resolve()
            return ft.group_id, ft.num_groups
        return self.group_index, self.dims.num_groups

    # ---- model --------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        self.job_end.setup(trainer)  # Lightning's setup, which JobEndHooks extends, is replaced here
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(f"{type(self).__name__} shards with FSDP2 (`fully_shard`); found FSDP1 modules.")
        if is_sharded(self.model):
            reshard_all(self.model)  # set up again after fit: a last no-grad forward left root units gathered
        else:
            if not self._auto_wrap:
                rank_zero_warn(
                    f"{type(self).__name__}: no `auto_wrap` classes, so each top-level child of the LightningModule"
                    " is one FSDP unit, gathered whole in every forward. Pass its blocks, e.g."
                    " auto_wrap=['lightning_fedshard.models.TransformerBlock'], to gather one block at a time."
                )
            apply_activation_checkpointing(self.model, self._activation_checkpointing)
            apply_compile(self.model, self._compile)
            apply_fsdp(
                self.model,
                self.fsdp_mesh,
                auto_wrap=self._auto_wrap,
                mp_policy=self._mixed_precision_policy(),
                shard_placement_fn=self._shard_placement_fn(),
            )
        check_fully_sharded(self.model)
        materialize(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_initial_state(self.model, self.device_mesh)
        if trainer.state.fn == TrainerFn.FITTING:
            self.ledger = CommLedger()  # a later validate/test keeps the fit's counts readable
        install_fsdp_counters(self.model, self.ledger, self.dims.replicate_size)
        if (compression := self._compression("gradients")) is not None:
            comm = DynamiQReduceScatter(compression, self.precision_plugin.stats, self._count_shard_bytes)
            install_dynamiq_reduce_scatter(self.model, comm)
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            named_params = list(self.model.named_parameters())
            fragments = None
            if self._schedule is not None:
                fragments = partition_fragments(self.model, named_params, self._schedule.fragments)
            if self.fault_tolerance is not None and self._member is None:
                self._member = self._join_federation()
            self._averager = FedAverager(
                named_params,
                fed_group=self.fed_group,
                replicate_group=self.device_mesh.get_group("replicate"),
                ledger=self.ledger,
                outer_optimizer=self.outer_optimizer,
                outer_lr=self._outer_lr,
                outer_momentum=self._outer_momentum,
                sync_dtype=self._sync_dtype,
                sync_mode=self.sync_mode,
                compression=self._compression("fed"),
                fragments=fragments,
                transport=self._member.transport if self._member else None,
            )
            if self._schedule is not None:
                self._streaming = StreamingSync(self._averager, self._schedule, rounds=self._member)
                if self._compression("fed") is not None and self._schedule.delay:
                    rank_zero_warn(
                        f"{type(self).__name__}: DynamiQ's compressed ring runs in the training thread, so each"
                        " fragment's average is computed when it is sent: staggered, but not overlapping compute."
                    )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_placement_fn(self) -> Callable[[nn.Parameter], Shard] | None:
        if self.shard_block is None:
            return None
        plan = BlockShardPlan.for_module(self.model, self.dims.shard_size, self.shard_block)
        rank_zero_info(f"{type(self).__name__}: {plan.report()}")
        if plan.unaligned:
            rank_zero_warn(
                f"{type(self).__name__}: FSDP2 cannot shard {len(plan.unaligned)} parameter(s) on {self.shard_block}-"
                f"coordinate boundaries ({', '.join(p.name for p in plan.unaligned[:4])}"
                f"{' …' if len(plan.unaligned) > 4 else ''}); their shards stay FSDP2's dim-0 chunks."
            )
        return plan.placement_fn

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

    def _compression(self, traffic: str) -> Compression | None:
        """The ``DynamiQ`` plugin's settings when it asks for ``traffic`` to be compressed."""
        plugin = self.precision_plugin
        return plugin.compression if isinstance(plugin, DynamiQ) and plugin.compresses(traffic) else None

    def _count_shard_bytes(self, nbytes: float) -> None:
        self.ledger.record_sent("shard", nbytes)

    def _mixed_precision_policy(self) -> MixedPrecisionPolicy:
        if getattr(self.precision_plugin, "precision", None) == "bf16-mixed":
            # bf16 halves the all-gather bytes; reducing in fp32 keeps small gradient contributions
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    # ---- federated rounds ---------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.optimizer_steps += 1
        if self._schedule is not None:
            self.stream_sync()
        elif self.optimizer_steps % self.sync_every == 0:
            self._in_step = True
            try:
                self.fed_sync()
            finally:
                self._in_step = False
        self._log_communication()
        return output

    def stream_sync(self) -> None:
        """Streaming sync after an optimizer step: sends the fragment average due now, applies the one due now."""
        fed = self.dims.fed_enabled or self._member is not None  # under fault tolerance a job is one group
        if not fed or self._streaming is None or not self._streaming.due(self.optimizer_steps):
            return
        reshard_all(self.model)
        self._in_step = True  # a group healing from this one's fragment round resumes after this step
        try:
            applied = self._streaming.step(self.optimizer_steps)
        finally:
            self._in_step = False
        if applied == self._schedule.fragments - 1:
            self.syncs += 1  # a round: every fragment averaged once
            self._steps_at_last_sync = self.optimizer_steps

    def fed_sync(self) -> None:
        """One cross-group round: reshard every FSDP unit, then average the local shards across groups."""
        if not (self.dims.fed_enabled or self._member) or self._averager is None:
            return
        reshard_all(self.model)
        if self._member is None:
            self._averager.sync()
        elif not self._member.run_round(self._average, self._apply_average):
            return
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
            if self._streaming.apply_due(self.optimizer_steps) == self._schedule.fragments - 1:
                self.syncs += 1
                self._steps_at_last_sync = self.optimizer_steps
        elif self._member.end_round(started, self._apply_average):
            self.syncs += 1
            self._steps_at_last_sync = self.optimizer_steps

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
                self.syncs += 1
                self._steps_at_last_sync = self.optimizer_steps
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

    @override
    def on_validation_start(self) -> None:
        self.ledger.paused = True  # evaluation traffic is not part of a training step
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        self.ledger.paused = False
        reshard_all(self.model)  # root units stay gathered after a no-grad forward; free that memory now
        super().on_validation_end()

    # ---- checkpoints --------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        reshard_all(self.model)
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=True))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=True))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Saves into a staging folder beside ``filepath``, verifies every group's files, writes the manifest and
        renames the folder into place: an interrupted save leaves any earlier checkpoint of that name intact."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        target, token = self.broadcast((str(filepath), uuid.uuid4().hex))
        path = Path(target)
        staging = staging_dir(path, token)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self._averager is not None:
            state["outer"] = self._averager.state_dict()
        if (pending := self._pending_average()) is not None:
            self._averager.complete(pending)  # what the groups averaged is saved; it is applied when due
            state["in_flight"] = self._in_flight_state(pending)
        files, failure = _attempt(self._save_group_share, staging, state)
        shares: list[Any] = [None] * self.world_size
        dist.all_gather_object(shares, (files, _message(failure)))
        errors = [error for _, error in shares if error]
        if self.global_rank == 0 and not errors:
            every_file = {name: entry for group_files, _ in shares for name, entry in group_files.items()}
            meta = {**checkpoint, FEDSHARD_KEY: self._fedshard_meta()}
            _, failure = _attempt(finish_save, staging, path, meta, every_file)
            errors = [_message(failure)] if failure else []
        errors = self.broadcast(errors)
        if errors:
            raise RuntimeError(
                f"Saving the checkpoint {target!r} failed, so it was not written (an earlier checkpoint of that name is"
                f" kept): {' | '.join(dict.fromkeys(errors))}"
            ) from failure

    def _save_group_share(self, staging: Path, state: dict[str, Any]) -> dict[str, list[int | str]]:
        save_group_state(staging, self.group_index, state, self._group_pg)
        return describe_group_share(staging, self.group_index, *self._group_share())

    def _fedshard_meta(self) -> dict[str, Any]:
        dims = self.dims
        return {
            "num_groups": dims.num_groups,
            "replicate_size": dims.replicate_size,
            "shard_size": dims.shard_size,
            "outer_optimizer": self.outer_optimizer,
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

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        meta = load_meta(path)
        saved = meta.pop(FEDSHARD_KEY)
        self._check_checkpoint_layout(saved, path)
        if FILES_KEY in saved:
            self._agree(verify_group_files, path, self.group_index, saved[FILES_KEY], *self._group_share())
        else:
            rank_zero_warn(
                f"The checkpoint {str(path)!r} has no file checksums (it was saved by an earlier lightning_fedshard):"
                " its files are checked for presence, length and finite values only."
            )
        assert self.model is not None
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(self.optimizers)})
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
        if in_flight is not None:
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
        self._agree(load_group_state, path, self.group_index, state, self._group_pg)
        set_model_state_dict(self.model, state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[f"optimizer_{i}"])
        if self._averager is not None:
            self._averager.load_state_dict(state["outer"])
        self.optimizer_steps = saved["optimizer_steps"]
        self._steps_at_last_sync = saved["steps_at_last_sync"]
        self.syncs = saved["syncs"]
        if in_flight is not None:
            assert self._streaming is not None
            params = [self._averager.named_params[i] for i in template.indices]
            for (name, p), view in zip(params, template.unflatten([p.to_local() for _, p in params]), strict=True):
                view.copy_(state["in_flight"][name].to_local())
            template.complete = True
            self._streaming.pending = template
        if self._member is not None and saved.get("torchft"):
            self._member.load_state_dict(saved["torchft"])
        return meta

    def _group_share(self) -> tuple[int, int]:
        """This rank's position in its federation group and the group's size: which files it hashes."""
        return dist.get_rank(self._group_pg), dist.get_world_size(self._group_pg)

    def _agree(self, check: Callable[..., None], *args: Any) -> None:
        """Runs ``check`` on every rank and raises on every rank if it failed on any: a rank that raised alone
        would leave the others waiting in the next collective."""
        _, failure = _attempt(check, *args)
        messages: list[str | None] = [None] * self.world_size
        dist.all_gather_object(messages, _message(failure))
        ranks_by_message: dict[str, list[int]] = {}
        for rank, message in enumerate(messages):
            if message:
                ranks_by_message.setdefault(message, []).append(rank)
        if ranks_by_message:
            raise ValueError(
                "\n".join(
                    f"[rank {', '.join(map(str, ranks))}] {message}" for message, ranks in ranks_by_message.items()
                )
            ) from failure

    def _check_checkpoint_layout(self, saved: dict[str, Any], path: Path) -> None:
        dims = self.dims
        expected = {"num_groups": dims.num_groups, "replicate_size": dims.replicate_size, "shard_size": dims.shard_size}
        found = {key: saved.get(key) for key in expected}
        if found != expected:
            raise ValueError(
                f"The checkpoint {str(path)!r} was saved with mesh {found} but this run uses {expected}."
                " Each federation group restores its own state, so the layout must match."
            )
        if saved.get("outer_optimizer") != self.outer_optimizer:
            raise ValueError(
                f"The checkpoint {str(path)!r} was saved with outer_optimizer={saved.get('outer_optimizer')!r},"
                f" this run uses {self.outer_optimizer!r}."
            )

    # ---- shutdown -----------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        if self._member is not None:
            self._member.shutdown()
            self._member = None
        super().teardown()
        if self._process_group_backend == "gloo" and not self.job_end.failed:
            destroy_process_group_at_exit()


#: The strategy's counters a healing group takes from its peer, so that it syncs at the same steps.
_ROUND_COUNTERS = ("optimizer_steps", "syncs", "_steps_at_last_sync")


def _attempt(action: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    try:
        return action(*args), None
    except Exception as err:  # noqa: BLE001  (every rank learns of it and raises, see FLHSDPStrategy._agree)
        return None, err


def _message(error: Exception | None) -> str | None:
    if error is None:
        return None
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def _fragment_schedule(
    sync_schedule: str, sync_every: int, fragments: int, delay: int, alpha: float, owner: str
) -> FragmentSchedule | None:
    """The streaming schedule, or None for blocking sync (which takes no fragment settings)."""
    if sync_schedule not in SYNC_SCHEDULES:
        raise ValueError(f"{owner}: unknown `sync_schedule={sync_schedule!r}`; choose one of {SYNC_SCHEDULES}.")
    if sync_schedule == "blocking":
        if (fragments, delay, alpha) != (1, 0, 0):
            raise ValueError(
                f"{owner}: `fragments`, `fragment_sync_delay` and `fragment_update_alpha` apply to"
                f" sync_schedule='streaming'; got fragments={fragments!r}, fragment_sync_delay={delay!r},"
                f" fragment_update_alpha={alpha!r} with sync_schedule='blocking'."
            )
        return None
    return FragmentSchedule.create(sync_every=sync_every, fragments=fragments, delay=delay, alpha=alpha, owner=owner)


#: dtypes the cross-group all-reduce averages in; narrower floats (float8) have no reduction in the backends.
SYNC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _resolve_dtype(dtype: str | torch.dtype, owner: str) -> torch.dtype:
    resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), None)
    if resolved not in SYNC_DTYPES:
        names = ", ".join(repr(str(d).removeprefix("torch.")) for d in SYNC_DTYPES)
        raise ValueError(f"{owner}: `sync_dtype={dtype!r}` is not a dtype the average can run in; use one of {names}.")
    return resolved


def _resolve_classes(
    specs: Sequence[str | type[nn.Module]] | None, arg: str, owner: str
) -> tuple[type[nn.Module], ...]:
    if specs is None:
        return ()
    if isinstance(specs, (str, type)):
        raise TypeError(
            f"{owner}: `{arg}` takes a list of module classes or import paths, got the single {specs!r};"
            f" write [{specs!r}]."
        )
    return tuple(_resolve_class(spec, arg, owner) for spec in specs)


def _resolve_class(spec: str | type[nn.Module], arg: str, owner: str) -> type[nn.Module]:
    if isinstance(spec, type):
        cls = spec
    else:
        module_name, _, class_name = str(spec).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"{owner}: cannot import the `{arg}` class {spec!r} ({err}).") from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"{owner}: `{arg}` entry {spec!r} is not an nn.Module class.")
    return cls
