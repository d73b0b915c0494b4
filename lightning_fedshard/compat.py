"""Every private torch and Lightning name the package relies on, checked in one place when it is imported.

The strategies subclass Lightning's ``ModelParallelStrategy`` and ``DDPStrategy`` and override or call their
private methods, install custom FSDP2 collectives through torch's private ``_fsdp_api`` classes, and read DCP
metadata whose pickle names private classes. None of these is a stable API: a torch or Lightning release may
rename or remove any of them. Importing them here, and checking here that the private methods and attributes
the package uses still exist, turns such a release into one clear error at ``import lightning_fedshard`` that
names what is missing and the versions the package supports, instead of an ``AttributeError`` deep inside a
run (or a strategy that silently stops overriding a method Lightning no longer calls).

The optional dependencies are imported through :func:`require_extra`, which names the extra that installs them.
"""

from __future__ import annotations

import copyreg
import inspect
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

# The torch-only checks (the verifier's, which must not import Lightning), re-exported here.
from lightning_fedshard._torch_compat import (
    SUPPORTED_VERSIONS,
    TorchDispatchMode,
    private,
    require_extra,
    tree_leaves,
    unsupported,
)

__all__ = [
    "SUPPORTED_VERSIONS",
    "_MEM_FORMAT_ENCODING",
    "_PATH",
    "AllGather",
    "C10dBackend",
    "ReduceScatter",
    "TorchDispatchMode",
    "_StorageInfo",
    "_StrategyRegistry",
    "_optimizers_to_device",
    "_set_sampler_epoch",
    "checkpoint",
    "epoch_loop_ready_batches_reached",
    "fit_loop_training_data",
    "layout_pickle_global",
    "require_extra",
    "set_sigterm_broadcast",
    "set_sigterm_notifier",
    "signal_connector",
    "tree_leaves",
]


def _unsupported(what: str) -> ImportError:
    return unsupported(what, f"torch {torch.__version__} / lightning {lightning.__version__}")


def _private(module: str, name: str) -> Any:
    """``module.name``, or an ImportError naming it and the supported versions."""
    return private(module, name, f"torch {torch.__version__} / lightning {lightning.__version__}")


def _check_methods(cls: type, *names: str, base: type = object) -> None:
    """The private methods the package overrides or calls still exist on ``cls``, implemented below ``base``
    (Lightning's ``Strategy`` has no-op versions of hooks that only its subclasses implement)."""
    for name in names:
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or owner is base or not callable(getattr(cls, name)):
            raise _unsupported(f"the private method `{cls.__module__}.{cls.__qualname__}.{name}`")


def _check_init_sets(cls: type, *names: str) -> None:
    """``cls.__init__`` still assigns the private instance attributes the package reads or writes.

    The names an ``__init__`` stores are in its code object's ``co_names``; checked without building an instance.
    """
    init = inspect.unwrap(cls.__init__)
    stored = init.__code__.co_names
    for name in names:
        if name not in stored:
            raise _unsupported(f"the private attribute `{cls.__module__}.{cls.__qualname__}.{name}` (set in __init__)")


def layout_pickle_global() -> tuple[str, str]:
    """``(module, qualname)`` of the function the installed torch pickles a ``torch.layout`` as.

    DCP's ``.metadata`` pickles each tensor's layout through the reducer torch registers with ``copyreg``
    (``torch.serialization._get_layout`` in torch 2.x); reading it from there instead of naming it keeps the
    checkpoint allow-list in step with whatever the installed torch writes.
    """
    reduce = copyreg.dispatch_table.get(torch.layout)
    if reduce is None:
        raise _unsupported("a copyreg pickle reducer for torch.layout (registered by torch.serialization)")
    rebuild = reduce(torch.strided)[0]
    return rebuild.__module__, rebuild.__qualname__


# --- torch ---------------------------------------------------------------------------------------------------
# FSDP2's custom collectives (DynamiQ's reduce-scatter, the byte ledger), torch >= 2.9.
AllGather = _private("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather")
ReduceScatter = _private("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter")
_check_methods(FSDPModule, "set_custom_all_gather", "set_custom_reduce_scatter")
# One timeout for every device-mesh group: the options of c10d backends (whose ``_timeout`` NCCL's options
# inherit) passed through init_device_mesh's backend_override (torch >= 2.9).
C10dBackend = _private("torch._C._distributed_c10d", "Backend")
if not hasattr(C10dBackend.Options, "_timeout"):
    raise _unsupported("the private `torch._C._distributed_c10d.Backend.Options._timeout`")
if "backend_override" not in inspect.signature(init_device_mesh).parameters:
    raise _unsupported("`torch.distributed.device_mesh.init_device_mesh(..., backend_override=...)`")
# Activation checkpointing of FSDP units.
checkpoint = _private("torch.distributed._composable", "checkpoint")
# The classes a DCP ``.metadata`` pickle names (the group checkpoints' allow-list).
_StorageInfo = _private("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_MEM_FORMAT_ENCODING = _private("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
layout_pickle_global()

# --- Lightning -----------------------------------------------------------------------------------------------
_optimizers_to_device = _private("lightning.fabric.utilities.optimizer", "_optimizers_to_device")
_PATH = _private("lightning.fabric.utilities.types", "_PATH")
_StrategyRegistry = _private("lightning.fabric.strategies.registry", "_StrategyRegistry")
# FLHSDPStrategy and TimedModelParallelStrategy override these and build the mesh themselves.
_check_methods(ModelParallelStrategy, "_configure_launcher", "_setup_distributed", base=Strategy)
_check_init_sets(
    ModelParallelStrategy,
    "_timeout",
    "_process_group_backend",
    "_data_parallel_size",
    "_tensor_parallel_size",
    "_device_mesh",
)
_check_init_sets(LightningModule, "_device_mesh", "_trainer")
# DynamiQDDPStrategy registers its compressed all-reduce in place of Lightning's hooks.
_check_methods(DDPStrategy, "_register_ddp_hooks", base=Strategy)
_check_init_sets(
    DDPStrategy, "_ddp_comm_hook", "_ddp_comm_state", "_ddp_comm_wrapper", "_timeout", "_process_group_backend"
)
# JobEnd (JobEndHooks) replaces the SIGTERM handler and the epoch loop's SIGTERM broadcast.
_check_init_sets(Trainer, "_signal_connector")
_check_methods(
    _private("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector"), "_sigterm_notifier_fn"
)
_TrainingEpochLoop = _private("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop")
_check_methods(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
# A federation group that heals from a peer (fault_tolerance.load_trainer_progress) restarts the training data at
# the peer's position and completes the peer's step as the epoch loop would.
_set_sampler_epoch = _private("lightning.fabric.utilities.data", "_set_sampler_epoch")
_check_init_sets(_private("lightning.pytorch.loops.fit_loop", "_FitLoop"), "_combined_loader", "_data_fetcher")
_check_methods(_TrainingEpochLoop, "_num_ready_batches_reached")


def signal_connector(trainer: Trainer) -> Any:
    """The trainer's signal connector: its public ``received_sigterm`` stops the fit at the next batch."""
    return trainer._signal_connector


def set_sigterm_notifier(connector: Any, notifier: Callable[[int, FrameType | None], None]) -> None:
    """Makes ``notifier`` what the connector's SIGTERM handler does (instead of broadcasting at once)."""
    connector._sigterm_notifier_fn = notifier


def set_sigterm_broadcast(epoch_loop: Any, agree: Callable[[], None]) -> bool:
    """Makes ``agree`` the collective that opens each training batch in place of Lightning's broadcast of rank 0's
    SIGTERM flag; False (nothing set) for a loop without that broadcast."""
    if not isinstance(epoch_loop, _TrainingEpochLoop):
        return False
    epoch_loop._broadcast_sigterm_tensor = agree
    return True


def fit_loop_training_data(fit_loop: Any) -> tuple[Any, Any]:
    """The fit loop's combined training loader and its data fetcher (either None before they are set up)."""
    return fit_loop._combined_loader, fit_loop._data_fetcher


def epoch_loop_ready_batches_reached(epoch_loop: Any) -> bool:
    """Whether the training epoch loop has read its epoch's last batch (epoch-interval schedulers step then)."""
    return epoch_loop._num_ready_batches_reached()
