"""FL+HSDP: federation groups that train with HSDP and average their parameter shards every few steps.

The strategy is the Lightning adaptor: it lays out the device mesh, shards the model and saves and loads its
checkpoints; its settings are :class:`~lightning_fedshard.strategies.fl_options.FLOptions`, its cross-group rounds
:class:`~lightning_fedshard.strategies.fl_rounds.FederatedRounds`, its checkpoint layout
:mod:`~lightning_fedshard.strategies.group_checkpoint`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
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
from lightning_fedshard.strategies.dims import FedShardDims
from lightning_fedshard.strategies.fault_tolerance import FaultTolerance
from lightning_fedshard.strategies.fl_options import FLOptions
from lightning_fedshard.strategies.fl_rounds import FederatedRounds
from lightning_fedshard.strategies.group_checkpoint import (
    FEDSHARD_KEY,
    agree,
    check_layout,
    load_group_state,
    load_meta,
    save_federated,
    verify_federated,
)
from lightning_fedshard.strategies.ledger import CommLedger, install_fsdp_counters

__all__ = ["FLHSDPStrategy"]


class FLHSDPStrategy(FederatedRounds, JobEndHooks, ModelParallelStrategy):
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
        self.options = FLOptions.create(
            name,
            min_replicate_size=self._min_replicate_size,
            num_groups=num_groups,
            shard_size=shard_size,
            replicate_size=replicate_size,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            sync_dtype=sync_dtype,
            sync_mode=sync_mode,
            sync_schedule=sync_schedule,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            auto_wrap=auto_wrap,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            shard_block=shard_block,
            fault_tolerance=fault_tolerance,
        )
        self._dims: FedShardDims | None = None
        self._group_pg: dist.ProcessGroup | None = None
        self._init_rounds()

    @property
    def sync_every(self) -> int:
        """Optimizer steps between cross-group syncs (H)."""
        return self.options.schedule.sync_every

    @property
    def shard_block(self) -> int | None:
        return self.options.shard_block

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        return self.options.fault_tolerance

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
                num_groups=self.options.num_groups,
                replicate_size=self.options.replicate_size,
                shard_size=self.options.shard_size,
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
        if self.fault_tolerance is not None:  # a missing address fails before any process starts
            self.options = replace(self.options, fault_tolerance=self.fault_tolerance.resolve())
        if None in (self.options.num_groups, self.options.replicate_size, self.options.shard_size):
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
        assert self.model is not None and self.accelerator is not None
        self.job_end.setup(trainer)  # Lightning's setup, which JobEndHooks extends, is replaced here
        self.accelerator.setup(trainer)
        self._shard_model()
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_initial_state(self.model, self.device_mesh)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.ledger = CommLedger()  # a later validate/test keeps the fit's counts readable
        self._count_and_compress_shard_traffic()
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
            self._build_rounds()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_model(self) -> None:
        """Shards the model with FSDP2 (unless its ``configure_model`` or an earlier fit did) and materialises it."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(f"{type(self).__name__} shards with FSDP2 (`fully_shard`); found FSDP1 modules.")
        if is_sharded(self.model):
            reshard_all(self.model)  # set up again after fit: a last no-grad forward left root units gathered
        else:
            if not self.options.auto_wrap:
                rank_zero_warn(
                    f"{type(self).__name__}: no `auto_wrap` classes, so each top-level child of the LightningModule"
                    " is one FSDP unit, gathered whole in every forward. Pass its blocks, e.g."
                    " auto_wrap=['lightning_fedshard.models.TransformerBlock'], to gather one block at a time."
                )
            apply_activation_checkpointing(self.model, self.options.activation_checkpointing)
            apply_compile(self.model, self.options.compile)
            apply_fsdp(
                self.model,
                self.fsdp_mesh,
                auto_wrap=self.options.auto_wrap,
                mp_policy=self._mixed_precision_policy(),
                shard_placement_fn=self._shard_placement_fn(),
            )
        check_fully_sharded(self.model)
        materialize(self.model, self.root_device)

    def _count_and_compress_shard_traffic(self) -> None:
        install_fsdp_counters(self.model, self.ledger, self.dims.replicate_size)
        if (compression := self._compression("gradients")) is not None:
            comm = DynamiQReduceScatter(compression, self.precision_plugin.stats, self._count_shard_bytes)
            install_dynamiq_reduce_scatter(self.model, comm)

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
            optimizer = optimizer.optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=True))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Saves into a staging folder beside ``filepath``, verifies every group's files, writes the manifest and
        renames the folder into place (:func:`~lightning_fedshard.strategies.group_checkpoint.save_federated`)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        target, token = self.broadcast((str(filepath), uuid.uuid4().hex))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        state.update(self._round_state())
        meta = {**self._mesh_sizes(), "outer_optimizer": self.options.outer_optimizer, **self._round_meta()}
        save_federated(target, token, state, {**checkpoint, FEDSHARD_KEY: meta}, self.group_index, self._group_pg)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        meta = load_meta(path)
        saved = meta.pop(FEDSHARD_KEY)
        check_layout(path, saved, self._mesh_sizes(), self.options.outer_optimizer)
        verify_federated(path, saved, self.group_index, self._group_pg)
        assert self.model is not None
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(self.optimizers)})
        round_state, in_flight = self._round_state_to_load(saved, path)
        state.update(round_state)
        agree(load_group_state, path, self.group_index, state, self._group_pg)
        set_model_state_dict(self.model, state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[f"optimizer_{i}"])
        self._load_round_state(state, saved, in_flight)
        return meta

    def _mesh_sizes(self) -> dict[str, int]:
        dims = self.dims
        return {"num_groups": dims.num_groups, "replicate_size": dims.replicate_size, "shard_size": dims.shard_size}

    # ---- shutdown -----------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        if self._member is not None:
            self._member.shutdown()
            self._member = None
        super().teardown()
        if self._process_group_backend == "gloo" and not self.job_end.failed:
            destroy_process_group_at_exit()
