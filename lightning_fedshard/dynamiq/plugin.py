"""``DynamiQ``: the Lightning plugin that switches compressed communication on for a Trainer."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_fedshard.dynamiq.collective import DEFAULT_MIN_NUMEL
from lightning_fedshard.dynamiq.ddp_hook import DynamiQHookState, dynamiq_hook
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = ["TRAFFIC", "DynamiQ"]

#: What can be compressed: data-parallel gradients (DDP buckets, FSDP2 reduce-scatters) and the
#: cross-group FedAvg of the fl_* strategies.
TRAFFIC = ("gradients", "fed")
_PRECISIONS = ("32-true", "64-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")


class DynamiQ(Precision):
    """Compressed gradient and FedAvg communication, as a plugin that composes with any precision.

    Lightning's ``plugins=`` accepts precision, checkpoint-IO, cluster-environment and layer-sync
    objects only, so DynamiQ is a precision plugin that delegates all precision work to the one
    named by ``precision`` and tells the strategy which traffic to compress: under ``ddp`` it
    registers the DynamiQ comm hook on the DDP model (on CPU/gloo as on CUDA/NCCL); the ``fl_fsdp``,
    ``fl_hsdp``, ``fsdp2`` and ``hsdp`` strategies read ``compression`` and ``traffic`` to compress
    their FSDP2 reduce-scatters and their cross-group averages. Each step it logs
    ``dynamiq/gradients/{wire_bytes,bits_per_coord[,vnmse]}``.

    Arguments:
        bits: Wire bits per coordinate (side information and per-hop widening included).
        precision: The precision it composes with (``"32-true"``, ``"bf16-mixed"``, ...).
        codec: A registered codec name; ``"dynamiq"`` or a baseline (``"bf16"``, ``"mxfp8"``, ...).
        topology: ``"ring"`` or ``"butterfly"``.
        traffic: Which of ``("gradients", "fed")`` to compress.
        min_numel: Tensors smaller than this use a plain all-reduce.
        debug: Measure the vNMSE against an exact all-reduce every call (costs one more all-reduce).

    Example::

        trainer = Trainer(strategy="fl_hsdp", plugins=[DynamiQ(bits=5.0, precision="bf16-mixed")])
    """

    def __init__(
        self,
        bits: float = 5.0,
        precision: str = "32-true",
        *,
        codec: str = "dynamiq",
        topology: str = "ring",
        traffic: Sequence[str] = TRAFFIC,
        min_numel: int = DEFAULT_MIN_NUMEL,
        debug: bool = False,
    ) -> None:
        unknown = set(traffic) - set(TRAFFIC)
        if unknown or not traffic:
            raise ValueError(f"DynamiQ: `traffic` must be a non-empty subset of {TRAFFIC}, got {tuple(traffic)}.")
        self.compression = Compression(codec=codec, bits=bits, topology=topology, min_numel=min_numel, debug=debug)
        self.traffic = tuple(traffic)
        self.inner = _precision_plugin(precision)
        self.precision = self.inner.precision
        self.stats = CompressionStats()
        self.hook_state: DynamiQHookState | None = None

    def compresses(self, traffic: str) -> bool:
        return traffic in self.traffic

    # ---- the strategy hands the wrapped model over here, after DDP wrapping, before the first step
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        if isinstance(model, DistributedDataParallel) and self.compresses("gradients"):
            self.hook_state = DynamiQHookState(self.compression, stats=self.stats)
            model.register_comm_hook(self.hook_state, dynamiq_hook)
        return self.inner.connect(model, optimizers, lr_schedulers)

    def optimizer_step(
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        output = self.inner.optimizer_step(optimizer, model, closure, **kwargs)
        if metrics := self.stats.take_metrics("dynamiq/gradients"):
            model.log_dict(metrics, on_step=True, on_epoch=False)
        return output

    # ---- everything else is the composed precision's business
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.inner.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.inner.forward_context():
            yield

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        return self.inner.pre_backward(tensor, module)

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        return self.inner.post_backward(tensor, module)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        self.inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def main_params(self, optimizer: Optimizer) -> Any:
        return self.inner.main_params(optimizer)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.inner.unscale_gradients(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def teardown(self) -> None:
        self.inner.teardown()


def _precision_plugin(precision: str) -> Precision:
    """The plugin Lightning itself picks for ``precision`` (its accelerator connector's rules)."""
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)
    if precision in ("16-mixed", "bf16-mixed"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if precision == "16-mixed" and device == "cpu":
            raise ValueError("DynamiQ: precision='16-mixed' needs CUDA; use 'bf16-mixed' on CPU.")
        return MixedPrecision(precision, device)
    raise ValueError(f"DynamiQ: unsupported precision {precision!r}; expected one of {_PRECISIONS}.")
