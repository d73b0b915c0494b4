"""Checks on checkpoint files that need no process group (DCP saves and loads one group in this process)."""

import argparse
import os
import pickle
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
