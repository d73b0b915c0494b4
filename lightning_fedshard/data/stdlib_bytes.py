"""An embedded corpus that needs no download: the running interpreter's own standard-library sources."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import Dataset

__all__ = ["VALIDATION_MODULES", "StdlibBytes", "stdlib_sources"]

#: Held out for validation; every CPython ships them.
VALIDATION_MODULES = ("difflib", "random", "string", "textwrap")


def stdlib_sources() -> list[Path]:
    """Top-level ``*.py`` files of the standard library, sorted so every rank sees the same corpus."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


class StdlibBytes(Dataset):
    """Byte-level next-token windows over the standard library: sample ``i`` is ``(x, y)`` with ``y`` = ``x``
    shifted by one byte.

    Example::

        train = StdlibBytes("train", seq_len=128)
        x, y = train[0]  # two int64 tensors of shape (128,)
    """

    def __init__(self, split: Literal["train", "val"], seq_len: int) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"StdlibBytes: `split` must be 'train' or 'val', got {split!r}.")
        if seq_len < 1:
            raise ValueError(f"StdlibBytes: `seq_len` must be ≥ 1, got {seq_len}.")
        files = [f for f in stdlib_sources() if (f.stem in VALIDATION_MODULES) == (split == "val")]
        data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
        windows = (data.numel() - 1) // seq_len
        if windows < 1:
            raise ValueError(
                f"StdlibBytes: the {split!r} corpus ({data.numel()} bytes) is shorter than one window of {seq_len}."
            )
        self.inputs = data[: windows * seq_len].view(windows, seq_len)
        self.targets = data[1 : windows * seq_len + 1].view(windows, seq_len)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]
