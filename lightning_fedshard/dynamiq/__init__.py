"""DynamiQ-L: compressed multi-hop all-reduce (ring or butterfly of point-to-point sends whose every hop
decompresses, accumulates and recompresses the partial sum), with the baseline codecs in the same harness.

Example::

    from lightning_fedshard import dynamiq
    dynamiq.all_reduce(grad, codec="dynamiq", bits=5.0)   # in-place sum, identical on every rank
"""

from lightning_fedshard.dynamiq import baselines
from lightning_fedshard.dynamiq.codec import CODECS, Codec, make_codec, register_codec
from lightning_fedshard.dynamiq.collective import (
    TOPOLOGIES,
    all_reduce,
    loopback_all_reduce,
    reduce_scatter,
    simulate_all_reduce,
    warm_up,
)
from lightning_fedshard.dynamiq.ddp_hook import DynamiQHookState, dynamiq_hook
from lightning_fedshard.dynamiq.dynamiq_codec import DynamiQCodec
from lightning_fedshard.dynamiq.fsdp import DynamiQReduceScatter
from lightning_fedshard.dynamiq.plugin import DynamiQ
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = [
    "CODECS",
    "TOPOLOGIES",
    "Codec",
    "Compression",
    "CompressionStats",
    "DynamiQ",
    "DynamiQCodec",
    "DynamiQHookState",
    "DynamiQReduceScatter",
    "all_reduce",
    "baselines",
    "dynamiq_hook",
    "loopback_all_reduce",
    "make_codec",
    "reduce_scatter",
    "register_codec",
    "simulate_all_reduce",
    "warm_up",
]
