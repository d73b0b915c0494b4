"""Baseline codecs for the compressed multi-hop all-reduce; importing this package registers them all.

``none``/``bf16``/``fp16`` (plain floats), ``int8``/``int4`` (block-32 integers, fp32 scales), the OCP MX
formats ``mxfp8``/``mxfp8_e5m2``/``mxfp6``/``mxfp6_e3m2``/``mxfp4``, ``thc`` (homomorphic integer sums
after a randomized Hadamard transform) and ``omnireduce`` (lossless non-zero blocks).
"""

from lightning_fedshard.dynamiq.baselines.blockint import BlockIntCodec, Int4Codec, Int8Codec
from lightning_fedshard.dynamiq.baselines.floats import BF16Codec, FloatCodec, FP16Codec, NoneCodec
from lightning_fedshard.dynamiq.baselines.mx import (
    MXCodec,
    MXFP4Codec,
    MXFP6Codec,
    MXFP6E3M2Codec,
    MXFP8Codec,
    MXFP8E5M2Codec,
)
from lightning_fedshard.dynamiq.baselines.omnireduce import OmniReduceCodec
from lightning_fedshard.dynamiq.baselines.thc import THCCodec

__all__ = [
    "BF16Codec",
    "BlockIntCodec",
    "FP16Codec",
    "FloatCodec",
    "Int4Codec",
    "Int8Codec",
    "MXCodec",
    "MXFP4Codec",
    "MXFP6Codec",
    "MXFP6E3M2Codec",
    "MXFP8Codec",
    "MXFP8E5M2Codec",
    "NoneCodec",
    "OmniReduceCodec",
    "THCCodec",
]
