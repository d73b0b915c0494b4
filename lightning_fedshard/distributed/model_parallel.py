"""Lightning's ``ModelParallelStrategy`` with its timeout on every group of its device mesh, ending together."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from typing_extensions import override

from lightning_fedshard.distributed.job_end import JobEndHooks
from lightning_fedshard.distributed.timeouts import check_timeout, init_device_mesh_with_timeout

__all__ = ["TimedModelParallelStrategy"]


class TimedModelParallelStrategy(JobEndHooks, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose ``("data_parallel", "tensor_parallel")`` mesh groups wait at most
    ``timeout`` in a collective, like its default group (Lightning's leave them at torch's 30 minutes), and whose
    ranks end together when one fails (:class:`~lightning_fedshard.distributed.JobEnd`).

    Example::

        strategy = TimedModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2,
                                              timeout=timedelta(minutes=5))
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size,
            tensor_parallel_size,
            save_distributed_checkpoint,
            process_group_backend,
            check_timeout(timeout, type(self).__name__),
        )

    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy.setup_environment, with the mesh built with the timeout
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = self.num_processes
        if self._data_parallel_size * self._tensor_parallel_size != self.world_size:
            raise RuntimeError(
                f"The sizes `data_parallel_size={self._data_parallel_size}` and `tensor_parallel_size="
                f"{self._tensor_parallel_size}` multiplied should equal the world size ({self.world_size})."
            )
        self._device_mesh = init_device_mesh_with_timeout(
            self.root_device.type,
            (self._data_parallel_size, self._tensor_parallel_size),
            ("data_parallel", "tensor_parallel"),
            self._timeout,
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
