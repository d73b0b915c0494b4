"""DynamiQ as a DDP communication hook.

No ``from __future__ import annotations`` here: DDP checks the hook's annotations at registration and
rejects string annotations.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fedshard.dynamiq.codec import Codec
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = ["DynamiQHookState", "dynamiq_hook"]


@dataclass
class DynamiQHookState:
    """What ``dynamiq_hook`` needs: the compression settings, the group, one codec instance and the stats.

    Example::

        state = DynamiQHookState(Compression(bits=5.0))
        ddp_model.register_comm_hook(state, dynamiq_hook)
    """

    compression: Compression = field(default_factory=Compression)
    process_group: ProcessGroup | None = None
    stats: CompressionStats = field(default_factory=CompressionStats)
    codec: Codec = field(init=False)

    def __post_init__(self) -> None:
        self.codec = self.compression.make_codec()


def dynamiq_hook(state: DynamiQHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages a gradient bucket through the compressed all-reduce (DDP hands the hook unscaled sums).

    The ring's point-to-point sends have no futures on gloo and are stream-ordered on NCCL, so the
    work is done when the hook returns and the future is already completed.
    """
    buffer = bucket.buffer()
    state.compression.all_reduce(buffer, state.codec, state.process_group, state.stats)
    buffer.div_(dist.get_world_size(state.process_group))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
