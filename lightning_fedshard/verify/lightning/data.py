"""VNN-COMP instances as a Lightning predict data source: one predict batch is one instance, the same on every rank
of a tensor-parallel (sharding) group, and the instances are dealt out over the data-parallel dimension."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_fedshard.verify.instances import Instance, read_instances, select_instances

__all__ = [
    "InstanceDataset",
    "InstanceSampler",
    "VnncompInstances",
    "as_instance",
    "data_parallel_layout",
]


def as_instance(item: Instance | dict | Sequence) -> Instance:
    """An :class:`~lightning_fedshard.verify.instances.Instance` from an instance, a predict batch dict
    (``onnx``, ``vnnlib``, ``timeout``) or an ``(onnx, vnnlib, timeout)`` tuple."""
    if isinstance(item, Instance):
        return item
    if isinstance(item, dict):
        return Instance(Path(item["onnx"]), Path(item["vnnlib"]), float(item["timeout"]))
    onnx, vnnlib, timeout = item
    return Instance(Path(onnx), Path(vnnlib), float(timeout))


class InstanceDataset(Dataset):
    """Item ``i``: ``{"index": i, "onnx": str, "vnnlib": str, "timeout": float}`` (plain values, which Lightning
    passes through its batch transfer and collation untouched)."""

    def __init__(self, instances: Sequence[Instance]) -> None:
        self.instances = [as_instance(i) for i in instances]

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, index: int) -> dict:
        instance = self.instances[index]
        return {
            "index": index,
            "onnx": str(instance.onnx),
            "vnnlib": str(instance.vnnlib),
            "timeout": float(instance.timeout),
        }


class InstanceSampler(DistributedSampler):
    """Instances ``rank, rank + num_replicas, …`` in order: no padding, no repeats, no shuffling, and a rank may get
    none (Lightning's predict sampler pads nothing either but asserts every rank gets one).

    ``num_replicas``/``rank`` are the data-parallel size and this rank's place in it: every rank of one
    tensor-parallel group has the same data-parallel rank, hence the same instances in the same order. Being a
    :class:`~torch.utils.data.DistributedSampler`, Lightning keeps it as it is rather than wrapping it again.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


def data_parallel_layout(strategy: object) -> tuple[int, int]:
    """``(size, rank)`` of the data-parallel dimension of a Lightning strategy: the ``data_parallel`` dim of a
    ``ModelParallelStrategy`` mesh, the world of other distributed strategies, ``(1, 0)`` on one device."""
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        sub = mesh["data_parallel"]
        return sub.size(), sub.get_local_rank()
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    if kwargs:
        return int(kwargs["num_replicas"]), int(kwargs["rank"])
    return 1, 0


class VnncompInstances(LightningDataModule):
    """The instances of a VNN-COMP ``instances.csv`` (or a given list) as ``trainer.predict`` batches.

    Each predict batch is one instance dict (``index``, ``onnx``, ``vnnlib``, ``timeout``). Under
    ``ModelParallelStrategy(data_parallel_size=D, tensor_parallel_size=P)`` the instances are dealt round-robin
    over the ``D`` data-parallel ranks, and the ``P`` ranks of a tensor-parallel group (which shard one
    verification run) all get the same ones in the same order; with ``D = 1`` every rank sees every instance.

    Example::

        data = VnncompInstances("mnist_fc_2022/instances.csv", networks=["mnist-net_256x2.onnx"], limit=5)
        trainer.predict(VerificationModule(VerifyConfig(), strategy="fsdp"), datamodule=data)
    """

    def __init__(
        self,
        source: str | Path | Sequence[Instance],
        networks: Sequence[str] | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        rows = read_instances(source) if isinstance(source, (str, Path)) else [as_instance(i) for i in source]
        self.instances = select_instances(rows, networks, limit, timeout)

    def predict_dataloader(self) -> DataLoader:
        dataset = InstanceDataset(self.instances)
        size, rank = data_parallel_layout(self.trainer.strategy) if self.trainer is not None else (1, 0)
        # batch_size=None: no collation, a batch is one instance dict
        return DataLoader(dataset, batch_size=None, sampler=InstanceSampler(dataset, size, rank))
