"""The three parallel dimensions of FL+FSDP / FL+HSDP and the device mesh built from them."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["FedShardDims", "MESH_DIM_NAMES"]

#: Outermost to innermost: ``init_device_mesh`` lays ranks out row-major, so ``shard`` gets contiguous
#: ranks (one node), ``replicate`` the next block, and only ``fed`` spans groups.
MESH_DIM_NAMES = ("fed", "replicate", "shard")


@dataclass(frozen=True)
class FedShardDims:
    """Sizes of the ``("fed", "replicate", "shard")`` mesh.

    ``num_groups`` federation groups each train one model copy with HSDP over
    ``replicate_size × shard_size`` ranks; ``replicate_size=1`` is plain FSDP inside a group.

    Example::

        dims = FedShardDims.resolve(world_size=8, devices_per_node=2, num_groups=2)
        assert (dims.num_groups, dims.replicate_size, dims.shard_size) == (2, 2, 2)
    """

    num_groups: int
    """F: federation groups; parameters are averaged across them every ``sync_every`` steps."""
    replicate_size: int
    """R: HSDP replicas inside a group (1 = FSDP)."""
    shard_size: int
    """S: ranks one parameter is sharded over; contiguous ranks, ideally one node."""

    def __post_init__(self) -> None:
        for name in ("num_groups", "replicate_size", "shard_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: `{name}` must be a positive integer, got {value!r}.")

    @property
    def world_size(self) -> int:
        return self.num_groups * self.replicate_size * self.shard_size

    @property
    def group_size(self) -> int:
        """Ranks in one federation group (one model copy)."""
        return self.replicate_size * self.shard_size

    @property
    def fed_enabled(self) -> bool:
        return self.num_groups > 1

    @classmethod
    def resolve(
        cls,
        world_size: int,
        devices_per_node: int,
        *,
        num_groups: int | None = None,
        replicate_size: int | None = None,
        shard_size: int | None = None,
        default_replicate_size: int = 1,
    ) -> FedShardDims:
        """Fill in the sizes left as ``None`` from the world size and check that they multiply to it.

        ``shard_size`` defaults to the devices per node, unless ``num_groups`` and ``replicate_size``
        are both given, in which case it takes the ranks left over. ``replicate_size`` takes the ranks
        left over when ``num_groups`` is given, else ``default_replicate_size``; ``num_groups`` takes
        the ranks left over.
        """
        if shard_size is None:
            if num_groups is not None and replicate_size is not None:
                shard_size = _leftover(world_size, num_groups * replicate_size, "shard_size")
            else:
                shard_size = devices_per_node
        if replicate_size is None:
            if num_groups is not None:
                replicate_size = _leftover(world_size, num_groups * shard_size, "replicate_size")
            else:
                replicate_size = default_replicate_size
        if num_groups is None:
            num_groups = _leftover(world_size, replicate_size * shard_size, "num_groups")
        dims = cls(num_groups, replicate_size, shard_size)
        if dims.world_size != world_size:
            raise ValueError(
                f"The mesh num_groups × replicate_size × shard_size = {num_groups} × {replicate_size} × {shard_size}"
                f" = {dims.world_size} does not fit the {world_size} processes (num_nodes × devices)."
                " Change the sizes or the number of devices so that the product equals the world size."
            )
        return dims

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 3-D ``("fed", "replicate", "shard")`` mesh over all ranks; needs an initialised process group."""
        return init_device_mesh(
            device_type, (self.num_groups, self.replicate_size, self.shard_size), mesh_dim_names=MESH_DIM_NAMES
        )

    @staticmethod
    def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
        """The mesh one model copy is sharded over: ``("replicate", "shard")`` for HSDP, ``("shard",)`` for FSDP."""
        if mesh["replicate"].size() > 1:
            return mesh["replicate", "shard"]
        return mesh["shard"]


def _leftover(world_size: int, divisor: int, name: str) -> int:
    if divisor < 1 or world_size % divisor:
        raise ValueError(
            f"Cannot derive `{name}`: the world size {world_size} is not divisible by the product {divisor} of the"
            " other mesh sizes. Pass sizes whose product divides the number of processes (num_nodes × devices)."
        )
    return world_size // divisor
