"""Checks on checkpoint files that need no process group."""

import argparse

import pytest
import torch

from lightning_fedshard.strategies.group_checkpoint import load_group_state, load_meta


def test_a_plain_lightning_checkpoint_is_not_taken_for_an_fl_one(tmp_path):
    (tmp_path / "meta.pt").write_bytes(b"")
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
    with pytest.raises(Exception, match="Weights only load failed"):
        load_meta(tmp_path)


def test_a_missing_group_folder_names_the_group(tmp_path):
    with pytest.raises(FileNotFoundError, match="no state for federation group 3"):
        load_group_state(tmp_path, 3, {}, None)
