"""The sharded runs of ``fedshard bench fuzz``: instances verified by ``run_predict`` on two ranks, one instance
at a time, so that an instance that ends the group (an error in a sharded run is not caught: see
docs/verification.md) is the one after the last result written. The fuzzer launches both ranks at once::

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m lightning_fedshard.bench.fuzz_sharded SPEC

(Lightning takes the ranks the launcher made instead of starting its own.) SPEC, a JSON file, holds ``jobs``
(``[strategy, onnx, vnnlib, timeout]`` rows), ``config`` (``VerifyConfig`` fields) and ``out``, a folder where
global rank 0 pickles job ``i``'s merged result as ``i.pickle`` as soon as it has it.
"""

from __future__ import annotations

import json
import logging
import pickle
import sys
import warnings
from pathlib import Path

import torch

from lightning_fedshard.verify import VerifyConfig, run_predict

__all__ = ["DEVICES", "main"]

DEVICES = 2


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)  # one thread per rank: two ranks share the fuzzer's cores
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fedshard.verify"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    spec = json.loads(Path(argv[0]).read_text())
    config, out = VerifyConfig(**spec["config"]), Path(spec["out"])
    for index, (strategy, onnx, vnnlib, timeout) in enumerate(spec["jobs"]):
        results = run_predict([(onnx, vnnlib, timeout)], config, strategy, DEVICES)
        if results is not None:  # global rank 0
            (out / f"{index}.pickle").write_bytes(pickle.dumps(results[0]))


if __name__ == "__main__":
    main()
