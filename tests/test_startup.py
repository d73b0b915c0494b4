"""Start-up of the verifier's path (issue 34): ``import lightning_fedshard.verify`` and ``fedshard verify --help``
import torch, onnx and numpy, not Lightning and the training stack; the lazy package root still exposes every public
name and still registers the strategy names for a Trainer. Each check runs in a fresh interpreter, as a user's would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING_STACK = ("lightning", "datasets", "torchmetrics", "matplotlib")


def _python(code: str) -> str:
    """``code`` run by a fresh interpreter on this checkout; its stdout (an AssertionError shows its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _loaded_after(code: str) -> list[str]:
    report = f"import sys, json; print(json.dumps([m for m in {TRAINING_STACK!r} if m in sys.modules]))"
    return json.loads(_python(f"{code}\n{report}").splitlines()[-1])


def test_importing_the_verifier_loads_no_training_stack():
    assert _loaded_after("import lightning_fedshard.verify") == []


def test_the_verify_help_path_loads_no_training_stack():
    # What `fedshard verify --help` imports: the entry point's module and the verify CLI it dispatches to; then the
    # help itself (argparse exits 0 after printing it).
    code = (
        "import sys\nfrom lightning_fedshard.cli import main\nsys.argv = ['fedshard', 'verify', '--help']\n"
        "try:\n    main()\nexcept SystemExit as stop:\n    assert stop.code == 0, stop.code\n"
    )
    assert _loaded_after(code) == []


_TRAINER = (
    "trainer = pl.Trainer(strategy='ddp_dynamiq', accelerator='cpu', devices=1, logger=False,"
    " enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
    "print(type(trainer.strategy).__name__)\n"
)


def test_the_package_root_exposes_every_public_name_and_registers_the_strategies():
    code = (
        "import lightning_fedshard as L\n"
        "print([n for n in L.__all__ if getattr(L, n, None) is None])\n"
        "import lightning.pytorch as pl\n" + _TRAINER
    )
    missing, strategy = _python(code).splitlines()[-2:]
    assert missing == "[]"
    assert strategy == "DynamiQDDPStrategy"


def test_strategy_names_resolve_when_lightning_is_imported_before_the_package():
    code = "import lightning.pytorch as pl\nimport lightning_fedshard\n" + _TRAINER
    assert _python(code).splitlines()[-1] == "DynamiQDDPStrategy"
