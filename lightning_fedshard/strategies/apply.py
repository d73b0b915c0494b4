"""Free functions that apply FSDP2 to a model and keep its copies consistent; called by the strategy, in order."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_fedshard.compat import checkpoint

__all__ = [
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "broadcast_initial_state",
    "check_fully_sharded",
    "fsdp_units",
    "is_sharded",
    "materialize",
    "reshard_all",
]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied anywhere in ``module`` (by the user's ``configure_model`` or by us)."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def apply_activation_checkpointing(module: nn.Module, classes: Sequence[type[nn.Module]]) -> int:
    """Recomputes the activations of every instance of ``classes`` in the backward pass instead of storing
    them; returns how many modules it applied to. Call before :func:`apply_fsdp`: the composable
    ``checkpoint`` keeps module types and parameter names, so sharding and checkpoints see the same model."""
    targets = [m for m in module.modules() if m is not module and isinstance(m, tuple(classes))]
    for target in targets:
        checkpoint(target)
    return len(targets)


def apply_compile(module: nn.Module, classes: Sequence[type[nn.Module]]) -> int:
    """Compiles the ``forward`` of every instance of ``classes`` with ``torch.compile`` (whole graphs), in place;
    returns how many modules it applied to. Call after :func:`apply_activation_checkpointing` and before
    :func:`apply_fsdp`, torchtitan's order (per-block compile: the blocks share one compiled graph).

    Only ``forward`` is compiled, not the module's call: FSDP2's gather/reshard hooks and the composable
    ``checkpoint``'s hooks run eagerly around the compiled code, and the module keeps its type and parameter names
    (checkpoints, ``auto_wrap`` and the Hugging Face export see the same model as without compiling), where
    torchtitan's ``torch.compile(block)`` wrapper would add ``_orig_mod`` to every name.
    """
    targets = [m for m in module.modules() if m is not module and isinstance(m, tuple(classes))]
    for target in targets:
        target.forward = torch.compile(target.forward, fullgraph=True)  # type: ignore[method-assign]
    return len(targets)


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    auto_wrap: Sequence[type[nn.Module]] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard] | None = None,
) -> None:
    """Shards every instance of the ``auto_wrap`` classes as its own FSDP2 unit, then each top-level child.

    A 1-D ``mesh`` gives FSDP, a 2-D ``("replicate", "shard")`` mesh gives HSDP. Units are gathered one
    block at a time, so peak memory holds one block's full weights, not the model's. The top-level
    children, not ``module`` itself, close the wrapping: a LightningModule runs its layers from
    ``training_step`` and never through its own ``forward``, where FSDP2 would gather a root unit.
    ``shard_placement_fn`` picks each parameter's ``Shard(dim)`` (default dim 0; see
    :class:`~lightning_fedshard.optim.ShardPlan`).
    """
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters {own} directly; FSDP2 cannot shard them without a forward"
            " that runs them. Move them into a submodule."
        )
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), "shard_placement_fn": shard_placement_fn}
    for unit in fsdp_units(module, auto_wrap):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, **kwargs)


def fsdp_units(module: nn.Module, auto_wrap: Sequence[type[nn.Module]] = ()) -> list[nn.Module]:
    """The modules :func:`apply_fsdp` makes FSDP2 units, in the order it shards them: every instance of the
    ``auto_wrap`` classes, then each top-level child that holds parameters. The top-level ones are FSDP2
    roots, which keep their parameters gathered from forward to backward."""
    block_types = tuple(auto_wrap)
    units = [sub for sub in module.modules() if sub is not module and block_types and isinstance(sub, block_types)]
    units += [child for child in module.children() if child not in units and any(True for _ in child.parameters())]
    return units


def check_fully_sharded(module: nn.Module) -> None:
    """Raises when a parameter escaped ``fully_shard``: nothing would reduce its gradients or average it
    across groups, so the model copies would drift apart silently."""
    plain = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"Parameters {plain[:5]}{' …' if len(plain) > 5 else ''} are not sharded by `fully_shard`. When"
            " `configure_model` shards the model itself it must cover every parameter (finish with"
            " `fully_shard` on the top-level modules), or leave sharding to the strategy's `auto_wrap`."
        )


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocates what was built on the meta device, one top-level child at a time, and initialises it with
    each module's ``reset_parameters()`` such that the model is the same for every mesh layout.

    Each module's sharded parameters are initialised as whole tensors (the same on every rank, given the
    same seed), of which every rank keeps its shard: one module's weights at a time are whole, never the
    model. Children without meta tensors are left alone: ``to_empty`` would also overwrite state that is
    not a parameter, such as a torchmetrics metric's accumulators and their defaults.
    """
    for child in module.children():
        if not any(t.is_meta for t in itertools.chain(child.parameters(), child.buffers())):
            continue
        child.to_empty(device=device)
        for sub in child.modules():
            if any(True for _ in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
                _reset_whole(sub, device)


@torch.no_grad()
def _reset_whole(module: nn.Module, device: torch.device) -> None:
    if not callable(getattr(module, "reset_parameters", None)):
        raise TypeError(
            f"{type(module).__name__} was built on the meta device but has no `reset_parameters()`; its tensors"
            " would stay uninitialised. Implement it, or build the model on a real device."
        )
    shards = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for name, p in shards.items():
        module.register_parameter(name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device)))
    module.reset_parameters()
    for name, p in shards.items():
        whole = module.get_parameter(name).detach()
        # src_data_rank=None: every rank cuts its own shard from its own copy, no communication
        p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local())
        module.register_parameter(name, p)


def reshard_all(module: nn.Module) -> None:
    """Frees unsharded parameters everywhere. The root unit keeps its parameters gathered after a no-grad
    forward (validation), and its registered parameters are then plain tensors instead of shards."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@torch.no_grad()
def broadcast_initial_state(module: nn.Module, mesh: DeviceMesh) -> None:
    """Makes every federation group and replica start from the same weights, whatever each rank's seed.

    FSDP2 never broadcasts initial weights. Parameter shards are copied from group 0 / replica 0 at the
    same shard position; buffers, which FSDP2 leaves whole on every rank, from global rank 0.
    """
    shards = [p.to_local() for p in module.parameters()]
    for dim in ("fed", "replicate"):
        if mesh[dim].size() > 1:
            group = mesh.get_group(dim)
            for shard in shards:
                dist.broadcast(shard, group=group, group_src=0)
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)
