"""The three parallel dimensions of FL+FSDP / FL+HSDP and the device mesh built from them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.device_mesh import DeviceMesh

from lightning_fedshard.distributed.timeouts import init_device_mesh_with_timeout

__all__ = ["MESH_DIM_NAMES", "FedShardDims"]

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
        min_groups: int = 1,
        min_replicas: int = 1,
    ) -> FedShardDims:
        """Fill in the sizes left as ``None`` so that the three multiply to the world size.

        Given sizes are kept as they are. Among the layouts that fit, a derived ``num_groups`` is at least
        ``min_groups`` and a derived ``replicate_size`` at least ``min_replicas`` (the dimensions a strategy's
        name promises); then ``shard_size`` is the largest that divides the devices per node (a parameter's
        shards stay on one node), ``replicate_size`` the smallest, and ``num_groups`` takes the rest. So on one
        node of 4 devices FL+HSDP (``min_groups=min_replicas=2``) is 2 × 2 × 1, and on 8 it is 2 × 2 × 2.
        """
        given = {"num_groups": num_groups, "replicate_size": replicate_size, "shard_size": shard_size}
        fixed = [size for size in given.values() if size is not None]
        if any(size < 1 for size in fixed):
            raise ValueError(f"{cls.__name__}: the mesh sizes must be positive integers, got {given}.")
        product = 1
        for size in fixed:
            product *= size
        if len(fixed) == 3 and product != world_size:
            raise ValueError(
                f"The mesh num_groups × replicate_size × shard_size = {num_groups} × {replicate_size} × {shard_size}"
                f" = {product} does not fit the {world_size} processes (num_nodes × devices)."
                " Change the sizes or the number of devices so that the product equals the world size."
            )
        if world_size % product:
            raise ValueError(
                f"Cannot derive the mesh: the world size {world_size} is not divisible by the product {product} of"
                f" the given sizes ({_describe({k: v for k, v in given.items() if v is not None})}). Pass sizes whose"
                " product divides the number of processes (num_nodes × devices)."
            )
        candidates = [
            (f, r, world_size // (f * r))
            for f in _divisors(world_size) if num_groups in (None, f) and (num_groups is not None or f >= min_groups)
            for r in _divisors(world_size // f)
            if replicate_size in (None, r) and (replicate_size is not None or r >= min_replicas)
        ]  # fmt: skip
        candidates = [c for c in candidates if shard_size in (None, c[2])]
        if not candidates:
            wanted = {
                "num_groups": num_groups if num_groups is not None else f"≥ {min_groups}",
                "replicate_size": replicate_size if replicate_size is not None else f"≥ {min_replicas}",
                "shard_size": shard_size if shard_size is not None else "any",
            }
            raise ValueError(
                f"Cannot lay out {world_size} processes (num_nodes × devices) as num_groups × replicate_size ×"
                f" shard_size with {_describe(wanted)}: the world is too small or not divisible. Use more devices,"
                " or pass sizes that multiply to the world size (e.g. num_groups=1 for a single group)."
            )
        _, replicate, shard = max(candidates, key=lambda c: (devices_per_node % c[2] == 0, c[2], -c[1]))
        return cls(world_size // (replicate * shard), replicate, shard)

    def build_mesh(self, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
        """The 3-D ``("fed", "replicate", "shard")`` mesh over all ranks, each of its process groups waiting at most
        ``timeout`` in a collective (``None``: torch's default); needs an initialised process group."""
        return init_device_mesh_with_timeout(
            device_type, (self.num_groups, self.replicate_size, self.shard_size), MESH_DIM_NAMES, timeout
        )

    def describe(self) -> str:
        """``"2 groups × 2 replicas × 1 shard"``."""
        return " × ".join(
            f"{n} {word}{'s' if n != 1 else ''}"
            for n, word in ((self.num_groups, "group"), (self.replicate_size, "replica"), (self.shard_size, "shard"))
        )

    @staticmethod
    def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
        """The mesh one model copy is sharded over: ``("replicate", "shard")`` for HSDP, ``("shard",)`` for FSDP."""
        if mesh["replicate"].size() > 1:
            return mesh["replicate", "shard"]
        return mesh["shard"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _describe(sizes: dict[str, object]) -> str:
    return ", ".join(f"{name}={value}" for name, value in sizes.items())
