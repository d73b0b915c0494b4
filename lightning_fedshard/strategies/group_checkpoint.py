"""Distributed checkpoints that keep each federation group's state apart, saved atomically and loaded safely.

Groups hold the same parameter names and shard offsets, so a world-level ``torch.distributed.checkpoint``
save would de-duplicate them and silently keep one arbitrary group per tensor. Each group instead writes
its own folder with a process group that spans only its ranks; replicas inside a group still de-duplicate.

Layout::

    <path>/group0/   .metadata + one .distcp file per writing rank of group 0
    <path>/group1/   ...
    <path>/meta.pt   Lightning's loop state plus the ``"fedshard"`` entry (mesh, counters, and the size and
                     SHA-256 of every group file), written by global rank 0 last

A save writes into ``.<name>.incomplete-<token>`` beside ``<path>`` and renames it to ``<path>`` only once
every group's files are verified and the manifest is written; an existing ``<path>`` is moved aside first and
removed only after the rename. An interrupted save therefore never damages a complete checkpoint, also one of
the same name (``last.ckpt``). Loading rejects unfinished saves by name, checks every file against the
manifest, unpickles DCP's ``.metadata`` admitting only DCP's metadata classes, reads non-tensor values with
``weights_only=True``, and refuses non-finite tensors.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.tensor import DTensor

from lightning_fedshard.compat import _MEM_FORMAT_ENCODING, _StorageInfo, layout_pickle_global

__all__ = [
    "FEDSHARD_KEY",
    "FILES_KEY",
    "META_FILENAME",
    "agree",
    "check_layout",
    "describe_group_share",
    "finish_save",
    "group_dir",
    "load_group_state",
    "load_meta",
    "save_federated",
    "save_group_state",
    "staging_dir",
    "verify_federated",
    "verify_group_files",
]

META_FILENAME = "meta.pt"
FEDSHARD_KEY = "fedshard"
FILES_KEY = "files"  # in the "fedshard" entry: {"group<k>/<file>": [size in bytes, SHA-256 hex digest]}
DCP_METADATA_FILENAME = ".metadata"

# What an interrupted save leaves beside ``<name>``: its unfinished folder, or the previous version moved aside.
_LEFTOVER = re.compile(r"\.(?P<target>.+)\.(?P<kind>incomplete|replaced)-(?P<token>[0-9a-f]+)")

# Everything a DCP ``.metadata`` pickle refers to (torch.distributed.checkpoint.metadata, FileSystemWriter),
# besides torch dtypes, the layout's rebuild function (:func:`layout_pickle_global`) and pathlib paths.
_METADATA_GLOBALS = {
    (cls.__module__, cls.__qualname__)
    for cls in (
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        _MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
    )
}

# ``StorageMeta.checkpoint_id`` is the path the checkpoint was saved to, pickled as the writer's pathlib class:
# ``pathlib.PosixPath`` or ``WindowsPath``, and ``pathlib._local.*`` from Python 3.13 (where the classes moved).
# Loading only records it, so each is read as the pure path of its flavour, which any Python on any OS can build.
_PATH_CLASSES = {
    "PurePath": PurePath,
    "Path": PurePath,
    "PurePosixPath": PurePosixPath,
    "PosixPath": PurePosixPath,
    "PureWindowsPath": PureWindowsPath,
    "WindowsPath": PureWindowsPath,
}

_HASH_CHUNK = 1 << 20


# ---- every rank of the world together: a whole checkpoint ---------------------------------------------


def save_federated(
    target: str, token: str, state: dict[str, Any], meta: dict[str, Any], group_index: int, group: ProcessGroup | None
) -> None:
    """Saves on every rank: each federation group's ``state`` into a staging folder beside ``target`` (``token``
    names it, the same on every rank), verified; global rank 0 then writes the manifest ``meta`` and renames the
    folder into place, so an interrupted save leaves any earlier checkpoint of that name intact. ``group`` spans
    this rank's federation group. Raises on every rank if the save failed on any."""
    path = Path(target)
    staging = staging_dir(path, token)
    files, failure = _attempt(_save_group_share, staging, group_index, state, group)
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (files, _message(failure)))
    errors = [error for _, error in shares if error]
    if dist.get_rank() == 0 and not errors:
        every_file = {name: entry for group_files, _ in shares for name, entry in group_files.items()}
        _, failure = _attempt(finish_save, staging, path, meta, every_file)
        errors = [_message(failure)] if failure else []
    errors = _from_rank_zero(errors)
    if errors:
        raise RuntimeError(
            f"Saving the checkpoint {target!r} failed, so it was not written (an earlier checkpoint of that name is"
            f" kept): {' | '.join(dict.fromkeys(errors))}"
        ) from failure


def _save_group_share(
    staging: Path, group_index: int, state: dict[str, Any], group: ProcessGroup | None
) -> dict[str, list[int | str]]:
    save_group_state(staging, group_index, state, group)
    return describe_group_share(staging, group_index, *_group_share(group))


def check_layout(path: Path, saved: dict[str, Any], mesh: dict[str, int], outer_optimizer: str) -> None:
    """The checkpoint's manifest entry ``saved`` has this run's mesh sizes and outer optimizer."""
    found = {key: saved.get(key) for key in mesh}
    if found != mesh:
        raise ValueError(
            f"The checkpoint {str(path)!r} was saved with mesh {found} but this run uses {mesh}."
            " Each federation group restores its own state, so the layout must match."
        )
    if saved.get("outer_optimizer") != outer_optimizer:
        raise ValueError(
            f"The checkpoint {str(path)!r} was saved with outer_optimizer={saved.get('outer_optimizer')!r},"
            f" this run uses {outer_optimizer!r}."
        )


def verify_federated(path: Path, saved: dict[str, Any], group_index: int, group: ProcessGroup | None) -> None:
    """Checks every rank's share of its group's files against the manifest entry ``saved`` (on every rank)."""
    if FILES_KEY in saved:
        agree(verify_group_files, path, group_index, saved[FILES_KEY], *_group_share(group))
    else:
        rank_zero_warn(
            f"The checkpoint {str(path)!r} has no file checksums (it was saved by an earlier lightning_fedshard):"
            " its files are checked for presence, length and finite values only."
        )


def agree(check: Callable[..., None], *args: Any) -> None:
    """Runs ``check`` on every rank and raises on every rank if it failed on any: a rank that raised alone
    would leave the others waiting in the next collective."""
    _, failure = _attempt(check, *args)
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, _message(failure))
    ranks_by_message: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message:
            ranks_by_message.setdefault(message, []).append(rank)
    if ranks_by_message:
        raise ValueError(
            "\n".join(f"[rank {', '.join(map(str, ranks))}] {message}" for message, ranks in ranks_by_message.items())
        ) from failure


def _group_share(group: ProcessGroup | None) -> tuple[int, int]:
    """This rank's position in its federation group and the group's size: which files it hashes."""
    return dist.get_rank(group), dist.get_world_size(group)


def _from_rank_zero(obj: Any) -> Any:
    objects = [obj]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def _attempt(action: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    try:
        return action(*args), None
    except Exception as err:  # noqa: BLE001  (every rank learns of it and raises, see agree)
        return None, err


def _message(error: Exception | None) -> str | None:
    if error is None:
        return None
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


# ---- one federation group's folder ---------------------------------------------------------------------


def group_dir(path: Path, group_index: int) -> Path:
    return path / f"group{group_index}"


def staging_dir(path: Path, token: str) -> Path:
    """Where a save of ``path`` is written until it is complete: beside it, so that the final rename stays on one
    filesystem, and hidden, so that Lightning never takes it for a checkpoint."""
    return path.with_name(f".{path.name}.incomplete-{token}")


def save_group_state(folder: Path, group_index: int, state: dict[str, Any], process_group: ProcessGroup | None) -> None:
    try:
        dcp.save(state, checkpoint_id=group_dir(folder, group_index), process_group=process_group)
    except dcp.CheckpointException as err:  # a BaseException, which would slip past the strategy's error handling
        raise RuntimeError(
            f"Saving federation group {group_index} into {str(folder)!r} failed: {_causes(err)}"
        ) from err


def describe_group_share(folder: Path, group_index: int, share: int, shares: int) -> dict[str, list[int | str]]:
    """Size and SHA-256 of the files of one group's saved folder that rank ``share`` of its ``shares`` ranks hashes.

    Rank 0 of the group also checks that the group's DCP metadata is readable and that every file it points
    into exists and is long enough.
    """
    folder_of_group = group_dir(folder, group_index)
    if share == 0:
        reader = _GroupReader(folder, group_index)
        reader.check_storage(reader.read_metadata())
    files = sorted(p for p in folder_of_group.iterdir() if p.is_file())
    return {f"{folder_of_group.name}/{p.name}": [p.stat().st_size, _sha256(p)] for p in files[share::shares]}


def finish_save(staging: Path, path: Path, checkpoint: dict[str, Any], files: dict[str, list[int | str]]) -> None:
    """Writes the manifest into the verified ``staging`` folder, then renames it to ``path`` (global rank 0 only).

    ``checkpoint[FEDSHARD_KEY]["num_groups"]`` groups must each have reported their files in ``files``.
    """
    num_groups = checkpoint[FEDSHARD_KEY]["num_groups"]
    missing = [k for k in range(num_groups) if f"group{k}/{DCP_METADATA_FILENAME}" not in files]
    if missing:
        raise ValueError(f"federation group(s) {missing} wrote no {DCP_METADATA_FILENAME} into {str(staging)!r}.")
    checkpoint[FEDSHARD_KEY] = {**checkpoint[FEDSHARD_KEY], FILES_KEY: dict(sorted(files.items()))}
    with (staging / META_FILENAME).open("wb") as stream:
        torch.save(checkpoint, stream)
        stream.flush()
        os.fsync(stream.fileno())
    _rename_into_place(staging, path)


def _rename_into_place(staging: Path, path: Path) -> None:
    token = _LEFTOVER.fullmatch(staging.name)["token"]  # type: ignore[index]
    if os.path.lexists(path):
        # Moved aside, not deleted: until the next rename ``path`` has a complete version, at one name or the other.
        os.rename(path, path.with_name(f".{path.name}.replaced-{token}"))
    os.rename(staging, path)
    _fsync_dir(path.parent)
    for leftover in _leftovers(path):  # this replaced version and any unfinished saves of the same name
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


def _leftovers(path: Path) -> list[Path]:
    """The unfinished saves and moved-aside versions of ``path``, oldest first."""
    if not path.parent.is_dir():
        return []
    found = [
        p
        for p in path.parent.glob(f".{glob.escape(path.name)}.*-*")
        if (m := _LEFTOVER.fullmatch(p.name)) and m["target"] == path.name
    ]
    return sorted(found, key=lambda p: p.lstat().st_mtime)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---- loading ----------------------------------------------------------------------------------------


def load_meta(path: Path) -> dict[str, Any]:
    """Reads ``meta.pt`` and checks that it belongs to a complete FL+FSDP/FL+HSDP checkpoint."""
    leftover = _LEFTOVER.fullmatch(path.name)
    if leftover and leftover["kind"] == "incomplete":
        raise ValueError(
            f"{str(path)!r} is an incomplete checkpoint: the unfinished save of {leftover['target']!r}, interrupted"
            " before its files were all written and verified. Resume from a complete checkpoint."
        )
    meta_file = path / META_FILENAME
    if not meta_file.is_file():
        raise _no_manifest_error(path)
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{str(meta_file)!r} cannot be read: {err}") from err
    if not isinstance(meta, dict) or FEDSHARD_KEY not in meta:
        raise ValueError(
            f"{str(meta_file)!r} has no {FEDSHARD_KEY!r} entry: the checkpoint was not written by an"
            " FL+FSDP/FL+HSDP strategy, so its groups may be mixed. Load it with the strategy that wrote it."
        )
    return meta


def _no_manifest_error(path: Path) -> Exception:
    if path.is_dir() and any(p.is_dir() and p.name.startswith("group") for p in path.iterdir()):
        return ValueError(
            f"{str(path)!r} is an incomplete checkpoint: it holds group folders but no {META_FILENAME}, which a save"
            " writes last, so its save was interrupted. Resume from a complete checkpoint."
        )
    if not os.path.lexists(path):
        leftovers = {m["kind"]: p for p in _leftovers(path) if (m := _LEFTOVER.fullmatch(p.name))}
        if "replaced" in leftovers:
            return FileNotFoundError(
                f"{str(path)!r} does not exist: a save replacing it was interrupted between two renames. Its previous"
                f" version is complete in {str(leftovers['replaced'])!r}; rename that folder to {path.name!r} to"
                " resume from it."
            )
        if "incomplete" in leftovers:
            return FileNotFoundError(
                f"{str(path)!r} does not exist: its save was interrupted, so it is incomplete (its unfinished files"
                f" are in {str(leftovers['incomplete'])!r}). Resume from a complete checkpoint."
            )
    return FileNotFoundError(
        f"{str(path)!r} is not an FL+FSDP/FL+HSDP checkpoint: expected a folder holding {META_FILENAME}"
        " and one group<k>/ folder per federation group."
    )


def verify_group_files(path: Path, group_index: int, files: dict[str, list[Any]], share: int, shares: int) -> None:
    """Checks one group's files against the manifest: all present at their saved sizes, and the ``share``-th of
    every ``shares`` files by SHA-256 (each rank of the group hashes its share)."""
    prefix = f"{group_dir(path, group_index).name}/"
    names = sorted(name for name in files if name.startswith(prefix))
    where = f"federation group {group_index} of {str(path)!r}"
    if not names:
        raise ValueError(f"{where}: the manifest {META_FILENAME} lists no files for this group.")
    for name in names:
        file, (size, _) = path / name, files[name]
        if not file.is_file():
            raise ValueError(f"{str(path)!r} is incomplete: {name} of federation group {group_index} is missing.")
        if (actual := file.stat().st_size) != size:
            raise ValueError(
                f"{where} is damaged: {name} has {actual} bytes, {size} when it was saved"
                f"{' (truncated)' if actual < size else ''}."
            )
    for name in names[share::shares]:
        if _sha256(path / name) != files[name][1]:
            raise ValueError(
                f"{where} is corrupt: {name} does not match the SHA-256 recorded in {META_FILENAME} when it was saved."
            )


def load_group_state(path: Path, group_index: int, state: dict[str, Any], process_group: ProcessGroup | None) -> None:
    """Loads in place into the (DTensor) values of ``state``, then checks that every loaded tensor is finite."""
    reader = _GroupReader(path, group_index)
    reader.check_storage(reader.read_metadata())
    try:
        dcp.load(state, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(), process_group=process_group)
    except dcp.CheckpointException as err:
        raise ValueError(f"Loading {reader.where} failed: {_causes(err)}") from err
    for key, tensor in _tensors(state):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if (local.is_floating_point() or local.is_complex()) and not bool(torch.isfinite(local).all()):
            raise ValueError(f"{reader.where}: the loaded tensor {key!r} holds non-finite values (NaN or inf).")


def _causes(err: dcp.CheckpointException) -> str:
    """The distinct errors of the ranks a DCP save or load failed on (its own message is a traceback per rank)."""
    return " | ".join(dict.fromkeys(str(exc) for exc, _ in err.failures.values()))


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}.{i}")


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP ``.metadata`` holds; anything else (``os.system``…) is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module, name) == layout_pickle_global():
            return super().find_class(module, name)
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
            return _PATH_CLASSES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _ForbiddenGlobal(f"{module}.{name}")


class _GroupReader(dcp.FileSystemReader):
    """DCP's file reader for one group's folder, reading ``.metadata`` through :class:`_MetadataUnpickler`
    (the stock reader hands it to ``pickle.load``) and naming the group and file in every error."""

    def __init__(self, path: Path, group_index: int) -> None:
        super().__init__(group_dir(path, group_index))
        self.folder = group_dir(path, group_index)
        self.where = f"federation group {group_index} of {str(path)!r}"

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        file = self.folder / DCP_METADATA_FILENAME
        if not file.is_file():
            raise ValueError(f"{self.where} is incomplete: it has no {file.relative_to(self.folder.parent)}.")
        try:
            with file.open("rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except _ForbiddenGlobal as err:
            raise ValueError(
                f"Refused to load {str(file)!r} ({self.where}): it asks to unpickle {err}, which is not a DCP metadata"
                " class. A file that names other globals can run code on load; load only checkpoints you trust."
            ) from None
        except Exception as err:
            raise ValueError(
                f"{str(file)!r} ({self.where}) is not a readable DCP metadata file (truncated or corrupt):"
                f" {type(err).__name__}: {err}"
            ) from err
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise TypeError(f"{str(file)!r} ({self.where}) holds a {type(metadata).__name__}, not DCP metadata.")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def check_storage(self, metadata: dcp_metadata.Metadata) -> None:
        """Every file the metadata points into lies in the group's folder, exists and is long enough."""
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            if not isinstance(info, _StorageInfo) or Path(info.relative_path).name != info.relative_path:
                raise ValueError(f"{self.where}: its {DCP_METADATA_FILENAME} points outside the group folder ({info}).")
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            file = self.folder / name
            if not file.is_file():
                raise ValueError(f"{self.where} is incomplete: {self.folder.name}/{name} is missing.")
            if (actual := file.stat().st_size) < size:
                raise ValueError(
                    f"{self.where} is damaged: {self.folder.name}/{name} is truncated ({actual} bytes, its"
                    f" {DCP_METADATA_FILENAME} needs {size})."
                )

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except Exception as err:
            names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            raise ValueError(
                f"{self.where}: reading {', '.join(f'{self.folder.name}/{n}' for n in names)} failed:"
                f" {type(err).__name__}: {err}"
            ) from err


class _WeightsOnlyLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values (optimizer hyper-parameters) are unpickled with
    ``weights_only=True``; the default uses ``weights_only=False``, which runs whatever code a crafted file holds."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # The default then unpickles this re-serialised copy, which can only hold what weights_only admitted.
        safe = io.BytesIO()
        torch.save(torch.load(value, map_location="cpu", weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)
