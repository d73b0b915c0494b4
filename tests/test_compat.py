"""lightning_fedshard.compat: a torch or Lightning without a private name the package uses fails at import, naming
it and the supported versions; a missing optional dependency fails where it is needed, naming its extra."""

import importlib

import lightning.fabric.utilities.optimizer
import pytest
import torch.distributed.fsdp._fully_shard._fsdp_api as fsdp_api
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule

from lightning_fedshard import compat


@pytest.fixture
def reimport(monkeypatch):
    """Re-runs compat's import-time checks; compat is re-imported intact once the test's patches are undone."""
    yield lambda: importlib.reload(compat)
    monkeypatch.undo()
    importlib.reload(compat)


def _init_without_timeout(self, *args, **kwargs):
    self._device_mesh = None  # a Lightning whose __init__ no longer sets _timeout


@pytest.mark.parametrize(
    ("owner", "name", "replacement", "message"),
    [
        (
            lightning.fabric.utilities.optimizer,
            "_optimizers_to_device",
            None,
            r"the private `lightning\.fabric\.utilities\.optimizer\._optimizers_to_device`",
        ),
        (
            fsdp_api,
            "ReduceScatter",
            None,
            r"the private `torch\.distributed\.fsdp\._fully_shard\._fsdp_api\.ReduceScat",
        ),
        (
            ModelParallelStrategy,
            "_configure_launcher",
            None,
            r"the private method `lightning\.pytorch\.strategies\.model_parallel\.ModelParallelStrategy\._configure_la",
        ),
        (FSDPModule, "set_custom_reduce_scatter", None, r"FSDPModule\.set_custom_reduce_scatter"),
        (
            ModelParallelStrategy,
            "__init__",
            _init_without_timeout,
            r"the private attribute `.*ModelParallelStrategy\._timeout` \(set in __init__\)",
        ),
    ],
)
def test_a_missing_private_name_fails_the_import_naming_it_and_the_supported_versions(
    monkeypatch, reimport, owner, name, replacement, message
):
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(ImportError, match=message) as raised:
        reimport()
    assert r"supports torch>=2.9 (tested with 2.13 and 2.14) and lightning>=2.6,<2.7" in str(raised.value)
    assert "the installed torch 2." in str(raised.value)
