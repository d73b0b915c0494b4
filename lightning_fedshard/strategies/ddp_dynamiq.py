"""``ddp_dynamiq``: DDP whose gradient all-reduce is DynamiQ's compressed ring, on CPU/gloo as on CUDA/NCCL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fedshard.distributed import JobEndHooks, check_timeout
from lightning_fedshard.dynamiq.collective import DEFAULT_MIN_NUMEL
from lightning_fedshard.dynamiq.ddp_hook import DynamiQHookState, dynamiq_hook
from lightning_fedshard.dynamiq.settings import Compression

__all__ = ["DynamiQDDPStrategy"]


class DynamiQDDPStrategy(JobEndHooks, DDPStrategy):
    """DDP with the DynamiQ comm hook; ``strategy="ddp_dynamiq"`` is this class with its defaults.

    Lightning's ``DDPStrategy`` registers comm hooks only on CUDA; this strategy registers them on every
    device, so the compressed ring also runs on CPU/gloo. Passing ``ddp_comm_hook=`` (for example
    torch's ``powerSGD_hook`` with a ``PowerSGDState``) runs that hook instead, also on CPU, where each
    bucket is finished before the next starts so that ranks issue collectives in one order. Each step
    logs ``dynamiq/gradients/{wire_bytes,bits_per_coord[,vnmse]}``.

    Arguments:
        codec, bits, topology, min_numel, debug: as in :class:`~lightning_fedshard.dynamiq.Compression`.
        **kwargs: ``DDPStrategy`` arguments (``process_group_backend``, ``bucket_cap_mb``, ``timeout``, ...).

    When one rank fails, the others on its machine end with it, and a SIGTERM stop exits with status 143
    (:class:`~lightning_fedshard.distributed.JobEnd`).

    Example::

        trainer = Trainer(strategy=DynamiQDDPStrategy(bits=5.0), accelerator="cpu", devices=4)
    """

    def __init__(
        self,
        codec: str = "dynamiq",
        bits: float = 5.0,
        topology: str = "ring",
        min_numel: int = DEFAULT_MIN_NUMEL,
        debug: bool = False,
        **kwargs: Any,
    ) -> None:
        if "timeout" in kwargs:
            kwargs["timeout"] = check_timeout(kwargs["timeout"], type(self).__name__)
        self.hook_state: DynamiQHookState | None = None
        if kwargs.get("ddp_comm_hook") is None:
            compression = Compression(codec=codec, bits=bits, topology=topology, min_numel=min_numel, debug=debug)
            self.hook_state = DynamiQHookState(compression)
            kwargs.update(ddp_comm_state=self.hook_state, ddp_comm_hook=dynamiq_hook)
        super().__init__(**kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":
            super()._register_ddp_hooks()
            return
        assert isinstance(self.model, DistributedDataParallel)
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=self._ddp_comm_state, hook=_one_bucket_at_a_time(hook))

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.hook_state is not None and (metrics := self.hook_state.stats.take_metrics("dynamiq/gradients")):
            module = self.lightning_module
            assert isinstance(module, pl.LightningModule)
            module.log_dict(metrics, on_step=True, on_epoch=False)
        return output


def _one_bucket_at_a_time(hook: Callable) -> Callable:
    """Finishes each bucket before DDP hands over the next. Gloo runs future callbacks on its own thread, so a
    hook that issues collectives from callbacks (PowerSGD) races the next bucket's hook and ranks disagree on
    the order of collectives ("Received data size doesn't match expected size")."""

    def finished_hook(state, bucket):  # unannotated: DDP rejects string annotations
        future = torch.futures.Future()
        future.set_result(hook(state, bucket).wait())
        return future

    finished_hook.__name__ = finished_hook.__qualname__ = getattr(hook, "__name__", "hook")
    return finished_hook
