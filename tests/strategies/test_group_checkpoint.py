"""Checks on checkpoint files that need no process group (DCP saves and loads one group in this process)."""

import argparse
import copyreg
import os
import pathlib
import pickle
import sys
from pathlib import Path

import pytest
import torch

from lightning_fedshard.strategies.group_checkpoint import (
    FEDSHARD_KEY,
    FILES_KEY,
    describe_group_share,
    finish_save,
    load_group_state,
    load_meta,
    save_group_state,
    staging_dir,
    verify_group_files,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(scale: float = 1.0) -> dict:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale
    optimizer = {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    return {"state_dict": {"w": weight, "b": torch.ones(2, dtype=torch.bfloat16)}, "optimizer_0": optimizer}


def _empty_like(state: dict) -> dict:
    optimizer = {"state": {"w": {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": None, "betas": None}]}
    return {"state_dict": {k: torch.zeros_like(v) for k, v in state["state_dict"].items()}, "optimizer_0": optimizer}


def _save(path: Path, state: dict, num_groups: int = 1, token: str = "0" * 32) -> Path:
    """What the strategy does on every rank, for a world of one rank per group, in this process."""
    staging = staging_dir(path, token)
    files = {}
    for group in range(num_groups):
        save_group_state(staging, group, state, None)
        files.update(describe_group_share(staging, group, 0, 1))
    finish_save(staging, path, {"epoch": 0, FEDSHARD_KEY: {"num_groups": num_groups, "optimizer_steps": 6}}, files)
    return path


def _load(path: Path, group: int = 0) -> dict:
    meta = load_meta(path)
    verify_group_files(path, group, meta[FEDSHARD_KEY][FILES_KEY], 0, 1)
    loaded = _empty_like(_state())
    load_group_state(path, group, loaded, None)
    return loaded


def test_a_saved_group_loads_back_tensors_and_hyper_parameters(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state(), num_groups=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]  # the staging folder was renamed, nothing left
    assert sorted(p.name for p in path.iterdir()) == ["group0", "group1", "meta.pt"]
    files = load_meta(path)[FEDSHARD_KEY][FILES_KEY]
    assert set(files) == {f"group{g}/{f}" for g in (0, 1) for f in (".metadata", "__0_0.distcp")}
    loaded = _load(path, group=1)
    torch.testing.assert_close(loaded["state_dict"], _state()["state_dict"])
    assert loaded["optimizer_0"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]


def test_a_save_replaces_a_checkpoint_of_the_same_name_only_once_complete(tmp_path):
    path = _save(tmp_path / "last.ckpt", _state(1.0))
    _save(path, _state(2.0), token="1" * 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    torch.testing.assert_close(_load(path)["state_dict"]["w"], _state(2.0)["state_dict"]["w"])
    (tmp_path / "file.ckpt").write_bytes(b"a single-file checkpoint")
    _save(tmp_path / "file.ckpt", _state())
    assert (tmp_path / "file.ckpt" / "meta.pt").is_file()


def test_leftovers_of_interrupted_saves_are_rejected_as_incomplete_by_name(tmp_path):
    staging = staging_dir(tmp_path / "epoch=0-step=6.ckpt", "ab" * 16)
    save_group_state(staging, 0, _state(), None)  # the save stopped before its manifest
    with pytest.raises(ValueError, match=r"is an incomplete checkpoint: the unfinished save of 'epoch=0-step=6.ckpt'"):
        load_meta(staging)
    with pytest.raises(FileNotFoundError, match=r"step=6.ckpt' does not exist: its save was interrupted, so it is"):
        load_meta(tmp_path / "epoch=0-step=6.ckpt")
    torn = tmp_path / "torn.ckpt"  # a folder written in place (before atomic saves), killed before meta.pt
    save_group_state(torn, 0, _state(), None)
    with pytest.raises(ValueError, match=r"torn.ckpt' is an incomplete checkpoint: it holds group folders but no meta"):
        load_meta(torn)


def test_a_replacement_interrupted_between_its_renames_points_to_the_previous_version(tmp_path):
    path = _save(tmp_path / "last.ckpt", _state())
    replaced = tmp_path / f".last.ckpt.replaced-{'c' * 32}"
    os.rename(path, replaced)
    with pytest.raises(
        FileNotFoundError, match=r"previous version is complete in .*\.last\.ckpt\.replaced-c+'; rename"
    ):
        load_meta(path)


def test_a_file_missing_from_a_group_is_reported_as_incomplete_not_as_fewer_groups(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state(), num_groups=2)
    (path / "group1" / "__0_0.distcp").unlink()
    files = load_meta(path)[FEDSHARD_KEY][FILES_KEY]
    verify_group_files(path, 0, files, 0, 1)
    with pytest.raises(
        ValueError, match=r"a.ckpt' is incomplete: group1/__0_0.distcp of federation group 1 is missing"
    ):
        verify_group_files(path, 1, files, 0, 1)
    with pytest.raises(ValueError, match=r"federation group 1 of .* is incomplete: group1/__0_0.distcp is missing"):
        load_group_state(path, 1, _empty_like(_state()), None)  # a checkpoint without checksums


def test_a_truncated_shard_names_its_file_and_group(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state(), num_groups=2)
    shard = path / "group1" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    files = load_meta(path)[FEDSHARD_KEY][FILES_KEY]
    with pytest.raises(
        ValueError, match=r"federation group 1 of .* is damaged: group1/__0_0.distcp has 100 bytes, \d+"
    ):
        verify_group_files(path, 1, files, 0, 1)
    with pytest.raises(ValueError, match=r"group 1 .* damaged: group1/__0_0.distcp is truncated \(100 bytes, its"):
        load_group_state(path, 1, _empty_like(_state()), None)


def test_a_shard_changed_after_saving_fails_its_checksum(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state())
    shard = path / "group0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    offset = data.find(torch.tensor([5.0]).numpy().tobytes())  # w[1, 1] of the saved weight
    data[offset : offset + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    shard.write_bytes(bytes(data))
    files = load_meta(path)[FEDSHARD_KEY][FILES_KEY]
    with pytest.raises(ValueError, match=r"group 0 .* is corrupt: group0/__0_0.distcp does not match the SHA-256"):
        verify_group_files(path, 0, files, 0, 1)
    with pytest.raises(ValueError, match=r"federation group 0 .*: the loaded tensor 'state_dict.w' holds non-finite"):
        load_group_state(path, 0, _empty_like(_state()), None)  # what a checkpoint without checksums still catches


def test_a_shape_mismatch_names_the_group_and_tensor(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state())
    wrong = _empty_like(_state())
    wrong["state_dict"]["w"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"Loading federation group 0 .* Size mismatch .* for state_dict.w"):
        load_group_state(path, 0, wrong, None)


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_dcp_metadata_is_refused_before_it_runs_anything(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state())
    marker = tmp_path / "ran"
    (path / "group0" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ValueError, match=r"Refused to load .*group0/.metadata.*: it asks to unpickle posix.system"):
        load_group_state(path, 0, _empty_like(_state()), None)
    with pytest.raises(ValueError, match=r"Refused to load"):
        describe_group_share(path, 0, 0, 1)  # the check a save makes of what it wrote
    assert not marker.exists()


def test_a_crafted_non_tensor_value_is_refused_before_it_runs_anything(tmp_path):
    marker = tmp_path / "ran"
    state = _state()
    state["optimizer_0"]["param_groups"][0]["lr"] = _RunsCode(marker)  # DCP pickles non-tensors with torch.save
    path = _save(tmp_path / "a.ckpt", state)
    with pytest.raises(ValueError, match=r"reading group0/__0_0.distcp failed: UnpicklingError: Weights only load"):
        load_group_state(path, 0, _empty_like(_state()), None)
    assert not marker.exists()


def test_a_truncated_dcp_metadata_names_its_file(tmp_path):
    path = _save(tmp_path / "a.ckpt", _state())
    metadata = path / "group0" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"group0/.metadata' \(federation group 0 .*\) is not a readable DCP metadata"):
        load_group_state(path, 0, _empty_like(_state()), None)


def test_a_plain_lightning_checkpoint_is_not_taken_for_an_fl_one(tmp_path):
    torch.save({"epoch": 1, "global_step": 8}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match="has no 'fedshard' entry"):
        load_meta(tmp_path)


def test_a_file_or_missing_folder_is_rejected(tmp_path):
    single_file = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, single_file)
    with pytest.raises(FileNotFoundError, match="is not an FL\\+FSDP/FL\\+HSDP checkpoint"):
        load_meta(single_file)
    with pytest.raises(FileNotFoundError, match="is not an FL\\+FSDP/FL\\+HSDP checkpoint"):
        load_meta(tmp_path / "missing")


def test_meta_is_loaded_with_weights_only(tmp_path):
    torch.save({"fedshard": {}, "obj": argparse.Namespace(code="runs on load")}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match="meta.pt' cannot be read: Weights only load failed"):
        load_meta(tmp_path)


def test_a_missing_group_folder_names_the_group(tmp_path):
    with pytest.raises(ValueError, match="federation group 3 of .* is incomplete: it has no group3/.metadata"):
        load_group_state(tmp_path, 3, {}, None)


class _RecordingUnpickler(pickle.Unpickler):
    """Plain pickle, noting every global a file names: what the installed torch writes into a DCP ``.metadata``."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.names: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.names.add((module, name))
        return super().find_class(module, name)


def _every_kind() -> dict:
    """Tensors of every dtype family, memory format and shape DCP records, and non-tensor values."""
    return {
        "float": {str(d): torch.ones(2, 3, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16)},
        "other": {
            "f64": torch.arange(4, dtype=torch.float64),
            "i64": torch.arange(3),
            "u8": torch.ones(2, dtype=torch.uint8),
            "bool": torch.ones(2, dtype=torch.bool),
            "c64": torch.ones(2, dtype=torch.complex64),
        },
        "channels_last": torch.ones(1, 2, 3, 4).to(memory_format=torch.channels_last),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 4),
        "hyper": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adamw", "none": None},
    }


def test_every_global_a_dcp_checkpoint_of_the_installed_torch_names_is_admitted(tmp_path):
    # Written by the installed torch: a torch upgrade that pickles DCP metadata through a new class fails here,
    # in CI, instead of making every checkpoint "refused" for users.
    state = _every_kind()
    save_group_state(tmp_path, 0, state, None)
    with (tmp_path / "group0" / ".metadata").open("rb") as stream:
        recorder = _RecordingUnpickler(stream)
        recorder.load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in recorder.names
    loaded = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    loaded["float"] = {k: torch.zeros_like(v) for k, v in state["float"].items()}
    loaded["other"] = {k: torch.zeros_like(v) for k, v in state["other"].items()}
    loaded["hyper"] = {"lr": None, "betas": None, "name": None, "none": 0}
    load_group_state(tmp_path, 0, loaded, None)  # through the allow-list: refuses any global it does not admit
    torch.testing.assert_close(loaded["other"], state["other"])
    torch.testing.assert_close(loaded["channels_last"], state["channels_last"])
    assert loaded["hyper"] == state["hyper"]


def _rebuild_layout(name: str) -> torch.layout:
    """A torch release's layout reducer under a name other than torch 2.x's ``torch.serialization._get_layout``."""
    return next(v for v in vars(torch).values() if isinstance(v, torch.layout) and str(v) == name)


def test_a_torch_that_pickles_layouts_through_another_function_still_loads(tmp_path, monkeypatch):
    # The allow-list takes the layout's rebuild function from the reducer the installed torch registers.
    monkeypatch.setitem(copyreg.dispatch_table, torch.layout, lambda layout: (_rebuild_layout, (str(layout),)))
    path = _save(tmp_path / "a.ckpt", _state())
    assert b"_rebuild_layout" in (path / "group0" / ".metadata").read_bytes()
    torch.testing.assert_close(_load(path)["state_dict"], _state()["state_dict"])


def _as_python_3_13(monkeypatch) -> bytes:
    """Pickles paths as Python 3.13 does: its pathlib classes are defined in ``pathlib._local``."""
    monkeypatch.setitem(sys.modules, "pathlib._local", pathlib)
    monkeypatch.setattr(pathlib.PosixPath, "__module__", "pathlib._local")
    return b"pathlib._local"


def _as_windows(monkeypatch) -> bytes:
    """Pickles paths as Windows does: as ``pathlib.WindowsPath``, which POSIX cannot instantiate."""
    monkeypatch.setattr(pathlib.PosixPath, "__reduce__", lambda self: (pathlib.WindowsPath, ("C:\\runs\\a.ckpt",)))
    return b"WindowsPath"


@pytest.mark.parametrize("writer", [_as_python_3_13, _as_windows])
def test_a_checkpoint_written_on_python_3_13_or_windows_loads(tmp_path, monkeypatch, writer):
    # DCP pickles the path a checkpoint was saved to (StorageMeta.checkpoint_id) as the writer's pathlib class.
    with monkeypatch.context() as patch:
        marker = writer(patch)
        path = _save(tmp_path / "a.ckpt", _state())
    assert marker in (path / "group0" / ".metadata").read_bytes()
    torch.testing.assert_close(_load(path)["state_dict"], _state()["state_dict"])
