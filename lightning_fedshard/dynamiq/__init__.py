"""DynamiQ-L: compressed multi-hop all-reduce (ring or butterfly of point-to-point sends whose every hop
decompresses, accumulates and recompresses the partial sum), with the baseline codecs in the same harness.

Example::

    from lightning_fedshard import dynamiq
    dynamiq.all_reduce(grad, codec="dynamiq", bits=5.0)   # in-place sum, identical on every rank
"""

from lightning_fedshard.dynamiq.codec import CODECS, Codec, make_codec, register_codec
from lightning_fedshard.dynamiq.collective import TOPOLOGIES, all_reduce, reduce_scatter
from lightning_fedshard.dynamiq.dynamiq_codec import DynamiQCodec
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = [
    "CODECS",
    "TOPOLOGIES",
    "Codec",
    "CompressionStats",
    "DynamiQCodec",
    "all_reduce",
    "make_codec",
    "reduce_scatter",
    "register_codec",
]
