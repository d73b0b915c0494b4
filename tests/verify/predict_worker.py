"""Verification in Lightning's predict loop; launched by the tests as a script (on CPU Lightning starts the other
ranks by re-running it). Usage: ``python predict_worker.py SPEC.json`` — SPEC holds ``out``, ``strategy``,
``devices``, optional ``group_size``/``tp_mode``/``max_zones``/``config`` (``VerifyConfig`` fields) and
``instances`` (``[onnx, vnnlib, timeout]`` rows); global rank 0 pickles ``run_predict``'s results to ``out``.
``fail_rank``: that rank raises when α-CROWN starts (a failure in the middle of a sharded run). A SPEC of
``{"runs": [spec, ...]}`` runs each in turn in the same processes (the interpreters start once)."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import torch

from lightning_fedshard.verify import verifier
from lightning_fedshard.verify.config import VerifyConfig
from lightning_fedshard.verify.lightning import run_predict

INJECTED = "injected failure in α-CROWN"


def _fail(*args, **kwargs):
    raise RuntimeError(INJECTED)


def main() -> None:
    torch.set_num_threads(1)  # two threads per rank on a loaded 2-core machine are pathologically slow
    document = json.loads(Path(sys.argv[1]).read_text())
    # the first run's Trainer spawns the other ranks; the later ones find them running
    for spec in document.get("runs", [document]):
        run(spec)


def run(spec: dict) -> None:
    if spec.get("fail_rank") is not None and int(os.environ.get("LOCAL_RANK", "0")) == spec["fail_rank"]:
        verifier.alpha_crown = _fail
    results = run_predict(
        [tuple(row) for row in spec["instances"]],
        VerifyConfig(**spec.get("config", {})),
        spec["strategy"],
        spec["devices"],
        spec.get("tp_mode", "rows"),
        spec.get("max_zones"),
        spec.get("group_size"),
    )
    if results is not None:
        Path(spec["out"]).write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    main()
