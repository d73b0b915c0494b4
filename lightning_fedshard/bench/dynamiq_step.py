"""``fedshard bench dynamiq-step``: what DynamiQ's compression costs one rank per training step, next to bf16.

A Llama preset's gradients, bucketed as DDP buckets them (its own assignment, 25 MiB buckets after a first of
1 MiB, from the parameter shapes on the meta device: no model is built), go through what one rank of a
``W``-rank ring computes for each bucket (``loopback_all_reduce``: its encodes, its ``W - 1`` decompress-accumulate-
recompress hops and its all-gather's decodes, every message looped back on the same device, no network). Side by
side, per step:

- ``dynamiq``: DynamiQ at ``--bits`` through that ring (the DDP hook's compute);
- ``bf16 ring``: the same ring with bf16 messages (cast, add in fp32, cast: the compute of a bf16 ring);
- ``bf16 cast``: what torch's ``bf16_compress_hook`` computes around NCCL's all-reduce (cast the bucket to bf16,
  divide, copy the result back into the fp32 bucket); NCCL's own reduction kernels are not in it.

Buckets under the collectives' ``min_numel`` take the plain all-reduce and cost no compression. With ``--step-ms``
(the model's own step time) each row also gives its share of a step. The gradients are random normal values:
the codecs' work depends on the sizes, not on the values. ``gpu_check``'s ``dynamiq-step`` runs it on CUDA for
``llama3.1-1b``.

Example::

    fedshard bench dynamiq-step --preset llama3.1-tiny --world-size 8          # CPU, seconds
    fedshard bench dynamiq-step --preset llama3.1-1b --device cuda --step-ms 450
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_fedshard._torch_compat import private
from lightning_fedshard.dynamiq.collective import DEFAULT_MIN_NUMEL, loopback_all_reduce
from lightning_fedshard.models.config import LlamaConfig
from lightning_fedshard.models.llama import Llama

__all__ = ["PATHS", "ddp_bucket_numels", "main", "step_costs"]

#: DDP's default bucket cap (``bucket_cap_mb``) and its first, smaller bucket.
BUCKET_CAP_MB = 25.0
_FIRST_BUCKET_BYTES = 1024 * 1024


def ddp_bucket_numels(preset: str, bucket_cap_mb: float = BUCKET_CAP_MB) -> list[int]:
    """The coordinates of each of ``preset``'s fp32 gradient buckets, by DDP's own assignment, in the order DDP
    reduces them (the last parameters' first)."""
    with torch.device("meta"):
        parameters = [p for p in Llama(LlamaConfig.from_name(preset)).parameters() if p.requires_grad]
    assign = private("torch.distributed", "_compute_bucket_assignment_by_size")
    limits = [_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024)]
    buckets, _ = assign(parameters, limits, [False] * len(parameters))
    return [sum(parameters[i].numel() for i in bucket) for bucket in reversed(buckets)]


def _bf16_cast(bucket: Tensor, world_size: int) -> None:
    """``bf16_compress_hook``'s compute around the all-reduce: cast, divide, decompress into the bucket."""
    compressed = bucket.to(torch.bfloat16).div_(world_size)
    bucket.copy_(compressed)


#: What each row computes on one bucket, one rank of ``world_size``.
PATHS: dict[str, Callable[[Tensor, int, float], object]] = {
    "dynamiq": lambda g, w, bits: loopback_all_reduce(g, world_size=w, codec="dynamiq", bits=bits),
    "bf16 ring": lambda g, w, bits: loopback_all_reduce(g, world_size=w, codec="bf16"),
    "bf16 cast": lambda g, w, bits: _bf16_cast(g, w),
}


def step_costs(
    preset: str = "llama3.1-tiny",
    world_size: int = 8,
    bits: float = 5.0,
    device: str = "cpu",
    steps: int = 3,
    budget_s: float = float("inf"),
    step_ms: float | None = None,
    seed: int = 0,
) -> dict:
    """Median ms per step of every path of :data:`PATHS` over ``preset``'s buckets on ``device``, after one warm-up
    step each (kernel compilation, buffers). The paths take turns, one step each per round, so that a busy machine
    slows them alike; ``steps`` rounds, fewer where the next would take the rounds past ``budget_s`` (at least one).
    """
    numels = ddp_bucket_numels(preset)
    generator = torch.Generator(device=device).manual_seed(seed)
    grads = [torch.randn(n, generator=generator, device=device) for n in numels if n >= DEFAULT_MIN_NUMEL]
    # the cast overwrites its buckets: it gets copies
    work = {name: [g.clone() for g in grads] if name == "bf16 cast" else grads for name in PATHS}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def step(name: str) -> float:
        sync()
        start = time.perf_counter()
        for g in work[name]:
            PATHS[name](g, world_size, bits)
        sync()
        return time.perf_counter() - start

    warm = {name: step(name) for name in PATHS}
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    rounds: list[float] = []
    while len(rounds) < steps and (not rounds or sum(rounds) + rounds[-1] < budget_s):
        for name in PATHS:
            times[name].append(step(name))
        rounds.append(sum(t[-1] for t in times.values()))
    rows = [
        {
            "path": name,
            "ms_per_step": 1e3 * sorted(times[name])[len(times[name]) // 2],
            "timed_steps": len(times[name]),
            "warm_up_ms": 1e3 * warm[name],
        }
        for name in PATHS
    ]
    bf16 = next(r["ms_per_step"] for r in rows if r["path"] == "bf16 ring")
    for row in rows:
        row["vs_bf16_ring"] = row["ms_per_step"] / bf16
        if step_ms:
            row["share_of_step"] = row["ms_per_step"] / step_ms
    return {
        "preset": preset,
        "device": str(torch.device(device)) if device != "cuda" else torch.cuda.get_device_name(),
        "world_size": world_size,
        "bits": bits,
        "buckets": len(grads),
        "coordinates": sum(g.numel() for g in grads),
        "rows": rows,
    }


def print_table(result: dict) -> None:
    print(
        f"{result['preset']}: {result['coordinates']:,} fp32 gradient coordinates in {result['buckets']} DDP buckets; "
        f"one rank of a {result['world_size']}-rank ring on {result['device']} (messages looped back, no network)"
    )
    share = any("share_of_step" in r for r in result["rows"])
    print(f"{'path':<10} {'ms/step':>10} {'× bf16 ring':>12} {'steps':>6}" + ("  of the step" if share else ""))
    for r in result["rows"]:
        line = f"{r['path']:<10} {r['ms_per_step']:>10.2f} {r['vs_bf16_ring']:>12.2f} {r['timed_steps']:>6}"
        print(line + (f"  {r['share_of_step']:.1%}" if share else ""))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedshard bench dynamiq-step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.1-tiny", help="a Llama preset (llama3.1-1b on a GPU)")
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the simulated ring")
    parser.add_argument("--bits", type=float, default=5.0, help="DynamiQ's wire bits per coordinate")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path (after one warm-up step)")
    parser.add_argument("--step-ms", type=float, default=None, help="the model's own step time, for the share")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    result = step_costs(args.preset, args.world_size, args.bits, args.device, args.steps, step_ms=args.step_ms)
    print_table(result)
    return result
