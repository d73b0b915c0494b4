"""Verification as a Lightning predict loop: one predict batch is one VNN-COMP instance, verified by the ranks of a
tensor-parallel group together (weights sharded FSDP-style, or tensor parallel), instances spread over the
data-parallel dimension of ``ModelParallelStrategy``'s device mesh."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer

from lightning_fedshard.distributed import TimedModelParallelStrategy, destroy_process_group_at_exit
from lightning_fedshard.verify.config import Verdict, VerifyConfig
from lightning_fedshard.verify.instances import Instance, run_instance
from lightning_fedshard.verify.lightning.data import VnncompInstances, as_instance
from lightning_fedshard.verify.result import RankReport, VerificationResult
from lightning_fedshard.verify.shard.plan import ShardPlan, Strategy, TensorParallelMode

__all__ = ["VerificationModule", "merge_rank_outputs", "predict_layout", "run_predict"]


class VerificationModule(LightningModule):
    """Verifies the instance of each predict batch (a dict with ``onnx``, ``vnnlib``, ``timeout``, optionally
    ``index``, as :class:`~lightning_fedshard.verify.lightning.data.VnncompInstances` yields).

    ``strategy`` (``single``, ``fsdp``, ``tp``; with ``tp_mode`` ``rows``/``zones`` and ``max_zones``) is the
    sharding of each run over the ``tensor_parallel`` dim of the ``ModelParallelStrategy`` device mesh; ``single``
    shards nothing (any ranks then take different instances). The module has no parameters and needs no optimizer.

    ``predict_step`` returns this rank's :class:`~lightning_fedshard.verify.result.VerificationResult` of the
    instance (:func:`~lightning_fedshard.verify.instances.run_instance`), with ``index`` and ``per_rank`` holding
    its own :class:`~lightning_fedshard.verify.result.RankReport`. An instance that fails to load does not stop
    the loop: it is an ``error`` result (on every rank of the group, since a load error on one rank raises on all
    of them) and the next instance is verified. An error in the
    middle of a sharded run ends the run on every rank of the group (the rank that failed raises; the others'
    next collective fails), so that no rank waits forever.

    Example::

        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            inference_mode=False,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
        )
        outputs = trainer.predict(
            VerificationModule(VerifyConfig(timeout=60), strategy="fsdp"),
            datamodule=VnncompInstances("mnist_fc_2022/instances.csv", limit=3),
        )
        [(o.vnnlib, o.verdict) for o in outputs]   # this rank's instances

    (:func:`run_predict` does all this, and gathers every rank's outputs on rank 0.)
    """

    def __init__(
        self,
        config: VerifyConfig | None = None,
        strategy: Strategy | str = Strategy.SINGLE,
        tp_mode: TensorParallelMode | str = TensorParallelMode.ROWS,
        max_zones: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config or VerifyConfig()
        self.strategy_name = Strategy(strategy)
        self.tp_mode = TensorParallelMode(tp_mode)
        self.max_zones = max_zones
        # a data-parallel rank may get no instance at all (fewer instances than data-parallel ranks)
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self._plan: ShardPlan | None = None

    def configure_model(self) -> None:
        """Nothing to parallelise (no parameters); ``ModelParallelStrategy`` requires the hook. The shard plan is
        built here, once the device mesh exists."""
        self._plan = self._build_plan()

    def _build_plan(self) -> ShardPlan:
        if self.strategy_name is Strategy.SINGLE:
            return ShardPlan()
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            raise RuntimeError(
                f"strategy {self.strategy_name.value!r} shards over the 'tensor_parallel' dim of a device mesh: "
                "run it under ModelParallelStrategy"
            )
        group = mesh["tensor_parallel"].get_group()
        return ShardPlan(self.strategy_name, group, self.tp_mode, self.max_zones)

    @property
    def plan(self) -> ShardPlan:
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _mesh_ranks(self) -> tuple[int, int]:
        mesh = self.device_mesh
        if mesh is None or set(mesh.mesh_dim_names or ()) != {"data_parallel", "tensor_parallel"}:
            return self.global_rank, 0
        return mesh["data_parallel"].get_local_rank(), mesh["tensor_parallel"].get_local_rank()

    def predict_step(self, batch: dict | Instance, batch_idx: int = 0) -> VerificationResult:
        instance = as_instance(batch)
        index = batch.get("index", batch_idx) if isinstance(batch, dict) else batch_idx
        # α-CROWN and β-CROWN optimise with autograd: undo the predict loop's inference/no-grad mode
        with torch.inference_mode(False), torch.enable_grad():
            result = run_instance(instance, self.config, self.plan, index)
        result.per_rank = [RankReport.of(result, self.global_rank, *self._mesh_ranks())]
        return result


def predict_layout(strategy: Strategy | str, devices: int, group_size: int | None = None) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` of a run on ``devices`` ranks: ``single`` spreads instances
    over all of them; ``fsdp``/``tp`` shard each instance over groups of ``group_size`` ranks (default: all)."""
    strategy = Strategy(strategy)
    if devices < 1:
        raise ValueError(f"devices must be ≥ 1, got {devices}")
    if strategy is Strategy.SINGLE:
        if group_size not in (None, 1):
            raise ValueError("strategy 'single' shards nothing: group_size must be 1")
        return devices, 1
    group_size = devices if group_size is None else group_size
    if group_size < 2:
        raise ValueError(f"strategy {strategy.value!r} shards each instance over ≥ 2 ranks, got {group_size}")
    if devices % group_size:
        raise ValueError(f"group_size {group_size} does not divide devices {devices}")
    return devices // group_size, group_size


def merge_rank_outputs(
    outputs: Sequence[VerificationResult], tensor_parallel_size: int, instances: Sequence[Instance] | None = None
) -> list[VerificationResult]:
    """One result per instance (sorted by ``index``) from the outputs of every rank: the tensor-parallel rank 0
    result, with ``per_rank`` holding every rank's report and ``time_s`` the slowest rank's. Ranks of a group that
    disagree on the verdict, or an instance verified by other than one group (or not at all, of ``instances``:
    item ``i`` has ``index`` ``i``), make the result an ``error``."""
    by_index: dict[int, list[VerificationResult]] = {}
    for out in outputs:
        by_index.setdefault(out.index, []).append(out)
    merged = []
    for index in sorted(set(by_index) | set(range(len(instances or ())))):
        entries = sorted(by_index.get(index, []), key=lambda o: o.per_rank[0].rank)
        if not entries:
            instance = as_instance(instances[index])
            missing = VerificationResult.failed("no rank verified this instance")
            missing.onnx, missing.vnnlib, missing.index = str(instance.onnx), str(instance.vnnlib), index
            merged.append(missing)
            continue
        ranks = [report for o in entries for report in o.per_rank]
        entry = replace(next((o for o in entries if o.per_rank[0].tp_rank == 0), entries[0]), per_rank=ranks)
        entry.time_s = max(r.time_s for r in ranks)
        problems = []
        if len(ranks) != tensor_parallel_size or len({r.dp_rank for r in ranks}) != 1:
            problems.append(f"verified by ranks {[r.rank for r in ranks]}, not one group of {tensor_parallel_size}")
        verdicts = {r.rank: r.verdict.value for r in ranks}
        if len(set(verdicts.values())) > 1:
            problems.append(f"ranks disagree on the verdict: {verdicts}")
        if problems:
            entry.verdict, entry.decided_by, entry.counterexample = Verdict.ERROR, None, None
            entry.error = "; ".join(([entry.error] if entry.error else []) + problems)
        merged.append(entry)
    return merged


def run_predict(
    instances: Sequence[Instance | dict | tuple] | VnncompInstances,
    config: VerifyConfig | None = None,
    strategy: Strategy | str = Strategy.SINGLE,
    devices: int = 1,
    tp_mode: TensorParallelMode | str = TensorParallelMode.ROWS,
    max_zones: int | None = None,
    group_size: int | None = None,
    accelerator: str = "cpu",
) -> list[VerificationResult] | None:
    """Verify ``instances`` with ``trainer.predict`` on ``devices`` ranks; the merged results
    (:func:`merge_rank_outputs`: one per instance, in order, with ``per_rank``) on global rank 0, ``None`` on
    the other ranks.

    One device with ``single``: a plain one-process Trainer. Otherwise ``ModelParallelStrategy`` with
    :func:`predict_layout`'s mesh. ``accelerator``: ``"cpu"`` (gloo), or ``"gpu"``/``"cuda"`` (NCCL, with gloo for
    the CPU tensors the verifier's collectives use today).

    More than one device on CPU uses Lightning's subprocess launcher: ranks 1… re-run the command line of this
    process (``sys.argv``, as a script or ``python -m module``), which must therefore reach this call again with
    the same arguments; call it once per process, from a script (not ``python -c`` or a notebook), and keep work
    meant for one process behind ``result is not None``. Set ``torch.set_num_threads`` before calling.

    Example::

        results = run_predict(read_instances("instances.csv"), VerifyConfig(timeout=60), "fsdp", devices=2)
        if results is not None:  # rank 0
            print([(r.vnnlib, r.verdict.value) for r in results])
    """
    config = config or VerifyConfig()
    strategy = Strategy(strategy)
    data_parallel, tensor_parallel = predict_layout(strategy, devices, group_size)
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError("accelerator 'gpu' asked for, but CUDA is not available")
        accelerator, backend = "cuda", "cpu:gloo,cuda:nccl"
    elif accelerator == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"accelerator must be 'cpu' or 'gpu', got {accelerator!r}")
    datamodule = instances if isinstance(instances, VnncompInstances) else VnncompInstances(list(instances))
    if devices == 1:
        trainer_strategy = "auto"
    else:
        trainer_strategy = TimedModelParallelStrategy(
            data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel, process_group_backend=backend
        )
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=trainer_strategy,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        inference_mode=False,
        use_distributed_sampler=False,  # VnncompInstances deals instances over the data-parallel dim itself
    )
    module = VerificationModule(config, strategy, tp_mode, max_zones)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*across ranks is zero.*")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
        outputs = trainer.predict(module, datamodule=datamodule) or []
    if trainer.world_size == 1:
        return merge_rank_outputs(outputs, 1, datamodule.instances)
    gathered: list[list[VerificationResult] | None] = [None] * trainer.world_size
    dist.all_gather_object(gathered, list(outputs))
    rank = trainer.global_rank
    if backend == "gloo":  # every rank got this far, so every rank will meet the exit handler's barrier
        destroy_process_group_at_exit()
    if rank != 0:
        return None
    return merge_rank_outputs([o for per_rank in gathered for o in per_rank], tensor_parallel, datamodule.instances)
