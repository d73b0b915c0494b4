"""lightning_fedshard.compat: a torch or Lightning without a private name the package uses fails at import, naming
it and the supported versions; a missing optional dependency fails where it is needed, naming its extra."""

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.fabric.utilities.optimizer
import pytest
import torch.distributed.fsdp._fully_shard._fsdp_api as fsdp_api
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule

from lightning_fedshard import compat

ROOT = Path(__file__).resolve().parents[1]


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
    assert r"supports torch>=2.9 (tested with 2.13) and lightning>=2.6,<2.7" in str(raised.value)
    assert "the installed torch 2." in str(raised.value)


_WITHOUT_EXTRAS = textwrap.dedent(
    """
    import sys, warnings
    sys.modules["torchft"] = None  # neither optional dependency can be imported
    sys.modules["highspy"] = None
    import lightning_fedshard
    from lightning_fedshard import FaultTolerance
    from lightning_fedshard.verify import VerifyConfig
    from lightning_fedshard.verify.config import Refine
    from lightning_fedshard.verify.shard.plan import ShardPlan
    from lightning_fedshard.verify.verifier import _refinement
    from tests.verify.nets import random_mlp

    try:
        FaultTolerance(lighthouse="http://localhost:29510", group_id=0).resolve()  # what the strategy's launcher calls
    except ImportError as err:
        print("FT:", err)
    graph = random_mlp(0, (4, 8, 8, 8, 3))  # three ReLU layers: refine="auto" picks the MILP
    try:
        _refinement(VerifyConfig(refine=Refine.MILP), graph, ShardPlan())
    except ImportError as err:
        print("MILP:", err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        print("AUTO:", _refinement(VerifyConfig(), graph, ShardPlan()).value, "|", caught[0].message)
    """
)


def test_without_torchft_and_highspy_the_package_imports_and_their_features_name_the_extra():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if line[:3] in ("FT:", "MIL", "AUT"))
    assert "FaultTolerance (fault-tolerant federation groups) needs `torchft`" in lines["FT"]
    assert "pip install 'lightning-fedshard[ft]'" in lines["FT"]
    assert "refine='milp' (LP/MILP bound refinement by HiGHS) needs `highspy`" in lines["MILP"]
    assert "pip install 'lightning-fedshard[lp]'" in lines["MILP"]
    auto, warning = lines["AUTO"].split(" | ")
    assert auto == "none"
    assert "Verifying without LP/MILP bound refinement" in warning and "lightning-fedshard[lp]" in warning
