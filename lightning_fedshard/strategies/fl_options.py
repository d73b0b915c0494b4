"""The FL+FSDP/FL+HSDP strategies' settings, checked once when the strategy is built."""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_fedshard.strategies.averager import OUTER_OPTIMIZERS, SYNC_MODES
from lightning_fedshard.strategies.fault_tolerance import FaultTolerance
from lightning_fedshard.strategies.streaming import FragmentSchedule

__all__ = ["SYNC_DTYPES", "FLOptions"]

#: dtypes the cross-group all-reduce averages in; narrower floats (float8) have no reduction in the backends.
SYNC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class FLOptions:
    """What :class:`~lightning_fedshard.strategies.FLHSDPStrategy` was asked for, validated and resolved: dtypes
    as ``torch.dtype``, module classes imported, the sync schedule built. :meth:`create` takes the strategy's
    arguments, all of them.

    Example::

        options = FLHSDPStrategy(sync_every=4, outer_optimizer="nesterov").options  # FLOptions.create(...)
        options.schedule.due(4), options.sync_dtype  # (True, torch.float32)
    """

    num_groups: int | None
    shard_size: int | None
    replicate_size: int | None
    schedule: FragmentSchedule
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    sync_dtype: torch.dtype
    sync_mode: str
    auto_wrap: tuple[type[nn.Module], ...]
    activation_checkpointing: tuple[type[nn.Module], ...]
    compile: tuple[type[nn.Module], ...]
    shard_block: int | None
    fault_tolerance: FaultTolerance | None

    @classmethod
    def create(
        cls,
        owner: str,
        *,
        min_replicate_size: int,
        num_groups: int | None,
        shard_size: int | None,
        replicate_size: int | None,
        sync_every: int,
        outer_optimizer: str,
        outer_lr: float,
        outer_momentum: float,
        sync_dtype: str | torch.dtype,
        sync_mode: str,
        sync_schedule: str,
        fragments: int,
        fragment_sync_delay: int,
        fragment_update_alpha: float,
        auto_wrap: Sequence[str | type[nn.Module]] | None,
        activation_checkpointing: Sequence[str | type[nn.Module]] | None,
        compile: Sequence[str | type[nn.Module]] | None,
        shard_block: int | None,
        fault_tolerance: FaultTolerance | None,
    ) -> FLOptions:
        """Checks every setting and names the one that is wrong, with ``owner`` (the strategy's class name)."""
        if not _is_int(sync_every) or sync_every < 1:
            raise ValueError(
                f"{owner}: `sync_every` must be an integer ≥ 1 (optimizer steps between syncs), got {sync_every!r}."
            )
        _check_outer_step(outer_optimizer, outer_lr, outer_momentum, owner)
        if sync_mode not in SYNC_MODES:
            raise ValueError(f"{owner}: unknown `sync_mode={sync_mode!r}`; choose one of {SYNC_MODES}.")
        schedule = FragmentSchedule.choose(
            sync_schedule,
            sync_every=sync_every,
            fragments=fragments,
            delay=fragment_sync_delay,
            alpha=fragment_update_alpha,
            owner=owner,
        )
        _check_sizes(num_groups, shard_size, replicate_size, shard_block, min_replicate_size, owner)
        _check_fault_tolerance(fault_tolerance, num_groups, owner)
        return cls(
            num_groups=num_groups,
            shard_size=shard_size,
            replicate_size=replicate_size,
            schedule=schedule,
            outer_optimizer=outer_optimizer,
            outer_lr=float(outer_lr),
            outer_momentum=float(outer_momentum),
            sync_dtype=_resolve_dtype(sync_dtype, owner),
            sync_mode=sync_mode,
            auto_wrap=_resolve_classes(auto_wrap, "auto_wrap", owner),
            activation_checkpointing=_resolve_classes(activation_checkpointing, "activation_checkpointing", owner),
            compile=_resolve_classes(compile, "compile", owner),
            shard_block=shard_block,
            fault_tolerance=fault_tolerance,
        )


def _check_outer_step(outer_optimizer: str, outer_lr: float, outer_momentum: float, owner: str) -> None:
    if outer_optimizer not in OUTER_OPTIMIZERS:
        raise ValueError(f"{owner}: unknown `outer_optimizer={outer_optimizer!r}`; choose one of {OUTER_OPTIMIZERS}.")
    if not _is_real(outer_lr) or not 0 < outer_lr < math.inf:
        raise ValueError(f"{owner}: `outer_lr` must be a finite number > 0, got {outer_lr!r}.")
    if not _is_real(outer_momentum) or not 0 <= outer_momentum < 1:
        raise ValueError(f"{owner}: `outer_momentum` must be a number in [0, 1), got {outer_momentum!r}.")


def _check_sizes(
    num_groups: int | None,
    shard_size: int | None,
    replicate_size: int | None,
    shard_block: int | None,
    min_replicate_size: int,
    owner: str,
) -> None:
    for arg, value in (("num_groups", num_groups), ("shard_size", shard_size)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{owner}: `{arg}` must be a positive integer or None, got {value!r}.")
    if replicate_size is not None and (not _is_int(replicate_size) or replicate_size < min_replicate_size):
        raise ValueError(
            f"{owner}: `replicate_size` must be an integer ≥ {min_replicate_size}, got {replicate_size!r}."
            " FL+HSDP needs at least two replicas per group; use FLFSDPStrategy (strategy='fl_fsdp') for groups"
            " without replication."
        )
    if shard_block is not None and (not _is_int(shard_block) or shard_block < 1):
        raise ValueError(f"{owner}: `shard_block` must be a positive integer or None, got {shard_block!r}.")


def _check_fault_tolerance(fault_tolerance: FaultTolerance | None, num_groups: int | None, owner: str) -> None:
    if fault_tolerance is None:
        return
    if not isinstance(fault_tolerance, FaultTolerance):
        raise TypeError(f"{owner}: `fault_tolerance` must be a FaultTolerance or None, got {fault_tolerance!r}.")
    if num_groups not in (None, 1):
        raise ValueError(
            f"{owner}: with `fault_tolerance` each federation group is a job of its own, so `num_groups` (groups"
            f" inside this job's world) must be 1 or None, got {num_groups!r}; start one job per group."
        )


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
