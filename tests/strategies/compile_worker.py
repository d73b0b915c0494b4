"""Trains the micro Llama under ``fsdp2`` on the CPU (gloo, world size 1) through the GPU check's
``llama_throughput``, eagerly and with every block compiled, and prints both runs' losses and how many graphs Dynamo
compiled, as JSON. Arguments: the ``torch.compile`` backend (``aot_eager`` traces and differentiates the blocks as
inductor would be given them, without generating C++ for them), then ``checkpointing`` to recompute activations."""

from __future__ import annotations

import functools
import json
import sys

import torch

backend, checkpointing = sys.argv[1], "checkpointing" in sys.argv[2:]
torch.compile = functools.partial(torch.compile, backend=backend)  # the strategy calls torch.compile(forward, ...)

from torch._dynamo.utils import counters  # noqa: E402

from lightning_fedshard.bench.gpu_check import llama_throughput  # noqa: E402

run = functools.partial(
    llama_throughput,
    accelerator="cpu",
    preset="llama3.1-micro",
    steps=4,
    warmup=1,
    batch=2,
    seq_len=32,
    precision="32-true",
    checkpointing=checkpointing,
)
eager, compiled = run(), run(compile=True)
print(
    json.dumps(
        {
            "eager": eager["details"][0]["losses"],
            "compiled": compiled["details"][0]["losses"],
            "status": [eager["status"], compiled["status"]],
            "graphs": counters["stats"]["unique_graphs"],
        }
    )
)
