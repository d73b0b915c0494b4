"""Datasets and data modules."""

from lightning_fedshard.data.stdlib_bytes import StdlibBytes

__all__ = ["StdlibBytes"]
