"""Distributed checkpoints that keep each federation group's state apart.

Groups hold the same parameter names and shard offsets, so a world-level ``torch.distributed.checkpoint``
save would de-duplicate them and silently keep one arbitrary group per tensor. Each group instead writes
its own folder with a process group that spans only its ranks; replicas inside a group still de-duplicate.

Layout::

    <path>/group0/   .metadata + one .distcp file per writing rank of group 0
    <path>/group1/   ...
    <path>/meta.pt   Lightning's loop state plus the ``"fedshard"`` entry, written by global rank 0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup

__all__ = ["META_FILENAME", "FEDSHARD_KEY", "group_dir", "save_group_state", "load_group_state", "load_meta"]

META_FILENAME = "meta.pt"
FEDSHARD_KEY = "fedshard"


def group_dir(path: Path, group_index: int) -> Path:
    return path / f"group{group_index}"


def save_group_state(path: Path, group_index: int, state: dict[str, Any], process_group: ProcessGroup | None) -> None:
    dcp.save(state, checkpoint_id=group_dir(path, group_index), process_group=process_group)


def load_group_state(path: Path, group_index: int, state: dict[str, Any], process_group: ProcessGroup | None) -> None:
    """Loads in place into the (DTensor) values of ``state``."""
    folder = group_dir(path, group_index)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"The checkpoint {str(path)!r} has no state for federation group {group_index} (expected {str(folder)!r})."
            " It was saved with fewer groups or is not an FL+FSDP/FL+HSDP checkpoint."
        )
    dcp.load(state, checkpoint_id=folder, process_group=process_group)


def load_meta(path: Path) -> dict[str, Any]:
    """Reads ``meta.pt`` and checks that it belongs to an FL+FSDP/FL+HSDP checkpoint."""
    meta_file = path / META_FILENAME
    if not path.is_dir() or not meta_file.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not an FL+FSDP/FL+HSDP checkpoint: expected a folder holding {META_FILENAME}"
            " and one group<k>/ folder per federation group."
        )
    meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    if not isinstance(meta, dict) or FEDSHARD_KEY not in meta:
        raise ValueError(
            f"{str(meta_file)!r} has no {FEDSHARD_KEY!r} entry: the checkpoint was not written by an"
            " FL+FSDP/FL+HSDP strategy, so its groups may be mixed. Load it with the strategy that wrote it."
        )
    return meta
