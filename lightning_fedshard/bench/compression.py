"""Gradient compression: DynamiQ-L next to the baseline codecs on the same multi-hop ring (research note §8).

    python -m lightning_fedshard.bench compression [--out runs/compression] [--quick] [--skip-training] [--steps 160]

(``fedshard bench compression ...`` and ``python -m lightning_fedshard.bench.compression ...`` are the same.)
Sections, each printed as a table and saved in ``OUT/results.json``:

a. Codec table: wire bits per coordinate and vNMSE of the all-reduced sum against the exact fp64 sum, on
   real tiny-Llama gradients (P = 4, 8, 16 simulated ranks), on Gaussian and heavy-tailed inputs (P = 8),
   the bias over codec seeds, and a real 4-process gloo run of every codec next to the simulated P = 4.
a'. Gradient zoo: every family of ``bench.gradients.gradient_zoo`` plus Gaussian and heavy-tailed inputs: DynamiQ's
   single-encode vNMSE next to the per-group Gaussian rate-distortion bound and the fixed-rate scalar oracle at
   the payload rate it spends, the ring at P = 4, 8, 16, and MXFP8-E4M3 at P = 8.
b. Target check: DynamiQ at 5 bits, P = 8, real gradients: ≤ 5 bits, vNMSE ≤ 1e-3 and below MXFP8-E4M3.
c. Decompress-accumulate-recompress (DAR) throughput against a plain copy of the same data.
d. Training: the tiny Llama recipe ``tiny/ddp_dynamiq`` with several codecs and PowerSGD.
e. ``OUT/vnmse_vs_bits.png``: vNMSE against bits per coordinate at P = 8 on the real gradients.

``--quick`` is a smoke run (fewer codecs and sizes, P ∈ {4, 8}, no training; about a minute). The full run takes
about 8 minutes on 2 CPU cores, most of it the five 160-step training runs.
"""

# No ``from __future__ import annotations``: DDP inspects ``PowerSGDHook.__call__``'s annotations at
# registration and rejects string annotations.

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from lightning_fedshard.bench.rate_distortion import gaussian_rd_bound, scalar_oracle
from lightning_fedshard.bench.recipes import TINY, metrics_path, read_metrics, run_recipe
from lightning_fedshard.dynamiq import (
    CODECS,
    Codec,
    CompressionStats,
    DynamiQCodec,
    all_reduce,
    make_codec,
    simulate_all_reduce,
    warm_up,
)
from lightning_fedshard.dynamiq.baselines import THCCodec
from lightning_fedshard.dynamiq.dynamiq_format import GROUP, split_message

__all__ = ["CodecRow", "PowerSGDHook", "bias", "codec_rows", "format_table", "heavy_tailed", "main", "vnmse"]

RECIPE = TINY / "ddp_dynamiq.yaml"
#: vNMSE / bias columns are computed over this many codec seeds (research note §8 asks for ≥ 5).
SEEDS = 8
#: Baselines in reading order; codecs registered later are appended, so the table covers all of ``CODECS``.
ORDER = (
    "none",
    "omnireduce",
    "bf16",
    "fp16",
    "int8",
    "int4",
    "mxfp8",
    "mxfp8_e5m2",
    "mxfp6",
    "mxfp6_e3m2",
    "mxfp4",
    "thc",
)
DYNAMIQ_BITS = (4.0, 5.0, 6.0)
SR_LABEL = "dynamiq (stochastic, antithetic)"
TARGET = {"label": "dynamiq 5.0", "bits": 5.0, "vnmse": 1.0e-3, "reference": "mxfp8"}


# ---------------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class CodecRow:
    """One row of the codec table: a registered codec at one rate, with a way to reseed its randomness."""

    label: str
    codec: str
    bits: float | None = None

    @property
    def stochastic(self) -> bool:
        return self.codec in ("dynamiq_sr", "thc")

    def make(self, seed: int = 0) -> Codec:
        """A fresh instance (codecs count their calls, so reusing one would change its dither)."""
        if self.codec == "dynamiq_sr":
            return DynamiQCodec(self.bits, rounding="stochastic", seed=seed)
        if self.codec == "thc":
            return THCCodec(self.bits, seed=seed)
        return make_codec(self.codec, self.bits)


def codec_rows(quick: bool = False) -> list[CodecRow]:
    """Every registered codec once (THC at its default rate), DynamiQ at 4, 5 and 6 bits and DynamiQ with
    antithetic stochastic rounding at 5 bits; ``quick`` keeps a representative handful."""
    names = [n for n in ORDER if n in CODECS] + [n for n in CODECS if n not in ORDER and not n.startswith("dynamiq")]
    if quick:
        names = [n for n in names if n in ("none", "bf16", "int8", "mxfp8", "mxfp4", "thc")]
    rows = [CodecRow("thc (4 b)" if n == "thc" else n, n) for n in names]
    rows += [CodecRow(f"dynamiq {b:.1f}", "dynamiq", b) for b in ((5.0,) if quick else DYNAMIQ_BITS)]
    rows.append(CodecRow(SR_LABEL, "dynamiq_sr", 5.0))
    return rows


# ---------------------------------------------------------------------------------------------- inputs
def gaussian(workers: int, numel: int, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(workers)]


def heavy_tailed(workers: int, numel: int, seed: int = 0, block: int = 4096) -> list[Tensor]:
    """Student-t(3) noise, independent per worker, times a log-uniform (1e-2..1) scale per block of ``block``
    coordinates that all workers share, like layers whose gradient magnitudes differ."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (-2.0 * torch.rand(-(-numel // block), generator=gen))
    scale = scale.repeat_interleave(block)[:numel]
    out = []
    for _ in range(workers):
        normal = torch.randn(numel, generator=gen)
        chi2 = torch.randn(3, numel, generator=gen).square().sum(dim=0)
        out.append(normal / (chi2 / 3).sqrt() * scale)
    return out


def exact_sum(inputs: Sequence[Tensor]) -> Tensor:
    total = torch.zeros(inputs[0].numel(), dtype=torch.float64)
    for x in inputs:
        total += x.reshape(-1).double()
    return total


# ---------------------------------------------------------------------------------------------- metrics
def vnmse(estimate: Tensor, exact: Tensor) -> float:
    """‖Ŝ − S‖² / ‖S‖², in fp64."""
    exact = exact.reshape(-1).double()
    return float((estimate.reshape(-1).double() - exact).square().sum() / exact.square().sum())


def bias(estimates: Sequence[Tensor], exact: Tensor) -> float:
    """‖mean_s Ŝ_s − S‖ / ‖S‖ over runs that differ only in the codec's seed. For a deterministic codec
    every run is the same, so this is its relative error ‖Ŝ − S‖ / ‖S‖; an unbiased one tends to 0 as
    ``√(vNMSE / runs)``."""
    exact = exact.reshape(-1).double()
    mean = torch.zeros_like(exact)
    for e in estimates:
        mean += e.reshape(-1).double()
    mean /= len(estimates)
    return float((mean - exact).norm() / exact.norm())


# ---------------------------------------------------------------------------------------------- tables
def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned, a rule under the header."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first, *rest = (str(c) for c in cells)
        return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])

    return "\n".join([line(headers), "-" * sum(widths + [2 * (len(widths) - 1)]), *(line(r) for r in rows)])


def _sci(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def _num(x: float | None, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


# ---------------------------------------------------------------------------------------------- a. codec table
def codec_table(rows: list[CodecRow], lm: list[Tensor], ps: Sequence[int], synthetic_numel: int) -> dict:
    """Simulated rings on every input; returns ``{label: {...}}`` plus, under ``"_p4_sums"``, the P = 4 sums
    that the gloo run is compared with."""
    inputs = {f"lm_p{p}": lm[:p] for p in ps}
    inputs["gauss_p8"] = gaussian(8, synthetic_numel, seed=1)
    inputs["t3_p8"] = heavy_tailed(8, synthetic_numel, seed=2)
    exact = {key: exact_sum(x) for key, x in inputs.items()}
    results: dict = {}
    p4_sums: dict[str, Tensor] = {}
    for row in rows:
        start = time.perf_counter()
        entry: dict = {"codec": row.codec, "bits_arg": row.bits, "stochastic": row.stochastic, "bits": {}, "vnmse": {}}
        for key, x in inputs.items():
            total, bits = simulate_all_reduce(x, codec=row.make())
            entry["bits"][key], entry["vnmse"][key] = bits, vnmse(total, exact[key])
            if key == "lm_p4":
                p4_sums[row.label] = total
            if key == "lm_p8" and not row.stochastic:
                entry["bias"] = bias([total], exact[key])
        if row.stochastic:
            runs = [simulate_all_reduce(inputs["lm_p8"], codec=row.make(seed))[0] for seed in range(SEEDS)]
            entry["bias"] = bias(runs, exact["lm_p8"])
            entry["vnmse_seeds_lm_p8"] = sum(vnmse(r, exact["lm_p8"]) for r in runs) / SEEDS
        # what an unbiased codec of this error would show after SEEDS runs
        entry["bias_floor"] = math.sqrt(entry.get("vnmse_seeds_lm_p8", entry["vnmse"]["lm_p8"]) / SEEDS)
        entry["seconds"] = time.perf_counter() - start
        results[row.label] = entry
        print(f"  {row.label}: {entry['seconds']:.1f} s", flush=True)
    results["_p4_sums"] = p4_sums
    return results


def print_codec_table(results: dict, ps: Sequence[int], lm_workers: int, synthetic_numel: int) -> None:
    has_gloo = any("gloo" in e and "vnmse" in e["gloo"] for e in results.values())
    headers = ["codec", "bits@P8"]
    for p in ps:
        headers.append(f"LM P={p}")
        if p == 4:
            headers.append("LM P=4 gloo")
    headers += ["gauss P=8", "t3 P=8", "bias", "floor"]
    lines = []
    for label, e in results.items():
        cells = [label, _num(e["bits"]["lm_p8"])]
        for p in ps:
            cells.append(_sci(e["vnmse"][f"lm_p{p}"]))
            if p == 4:
                cells.append(_sci(e.get("gloo", {}).get("vnmse")) if has_gloo else "—")
        cells += [_sci(e["vnmse"]["gauss_p8"]), _sci(e["vnmse"]["t3_p8"]), _sci(e["bias"]), _sci(e["bias_floor"])]
        lines.append(cells)
    print(format_table(headers, lines))
    notes = [
        "vNMSE = ||S^ - S||^2 / ||S||^2 of the all-reduced sum against the exact fp64 sum; ring reduce-scatter with",
        "  per-hop decompress-accumulate-recompress, then an all-gather of each owner's encoded sum.",
        "bits@P8 = wire bits per coordinate at P=8 on LM gradients (side information, headers and THC's scale",
        "  all-reduce included) / the 2(P-1)/P coordinates an exact ring sends. Bits at every P are in results.json.",
        f"LM = real tiny-Llama gradients (853,376 coords), {lm_workers} distinct workers"
        + (" (P=16 uses 16 distinct ones)." if lm_workers >= 16 else "."),
        "LM P=4 gloo = the same P=4 all-reduce run by 4 real gloo processes (see the consistency table below).",
        "gauss = iid N(0,1), t3 = Student-t(3) x log-uniform 1e-2..1 scale per 4096-block (shared by the workers);",
        f"  {synthetic_numel:,} coords, 8 independent workers.",
        f"bias = ||mean over {SEEDS} codec seeds of S^ - S|| / ||S||, LM gradients, P=8. Only thc and dynamiq_sr have",
        "  randomness; every other codec is deterministic and its bias is its relative error ||S^ - S|| / ||S||.",
        f"floor = sqrt(vNMSE / {SEEDS}): what an unbiased codec with this error shows after {SEEDS} seeds.",
    ]
    print("\n".join(notes))


# ---------------------------------------------------------------------------------------------- a'. gradient zoo
ZOO_PS = (4, 8, 16)
#: The issue's bars: single-encode within 1.15x of the scalar oracle, the P = 8 ring within 2x of single-encode.
ORACLE_BAR, RING_BAR = 1.15, 2.0


@contextlib.contextmanager
def eager_codecs():
    """DynamiQ on CPU in its torch reference functions instead of its C kernels (the DAR table's baseline)."""
    previous = os.environ.get("FEDSHARD_DYNAMIQ_COMPILE")
    os.environ["FEDSHARD_DYNAMIQ_COMPILE"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("FEDSHARD_DYNAMIQ_COMPILE")
        else:
            os.environ["FEDSHARD_DYNAMIQ_COMPILE"] = previous


def single_encode(x: Tensor, bits: float) -> tuple[float, float]:
    """vNMSE of one DynamiQ encode of ``x`` (a whole number of super-groups) and the payload bits per coordinate
    it spent (the mean group width; side information excluded)."""
    codec = DynamiQCodec(bits)
    msg = codec.encode(x, 1)
    budget = codec.payload_bits(1) * (x.numel() // 256)
    widths = split_message(msg, x.numel(), budget)[2]
    return vnmse(codec.decode(msg, x.numel(), 1), x), float(widths.sum()) / (x.numel() // GROUP)


def ring_allocation_bound(grads: Sequence[Tensor]) -> float:
    """The least ring/single-encode vNMSE ratio any split of the same wire bits over the ring's messages reaches,
    for a codec whose error falls 4x per bit (the steepest a rate-distortion curve falls).

    Hop ``h`` sends the partial sum of ``h`` gradients (energy ``E_h``) once, the all-gather sends the finished
    sum ``P - 1`` times; the sum's error is ``Σ_h (E_h/E_P)·4^-b_h + 4^-b_AG``. Minimising it under the budget
    (Lagrange: each message's error share proportional to how often it is sent) gives
    ``2(P-1) · 2^(Σ n_h·log2(c_h/n_h) / 2(P-1))`` times the single encode's ``4^-b`` (``c_h`` the weights,
    ``n_h`` the sends). For P = 8: 3.44 for independent gradients, 2.24 for identical ones."""
    p = len(grads)
    partial = torch.zeros(grads[0].numel(), dtype=torch.float64)
    energies = []
    for g in grads:
        partial += g.double()
        energies.append(float(partial.square().sum()))
    terms = [(energies[h] / energies[-1], 1) for h in range(p - 1)] + [(1.0, p - 1)]
    messages = 2 * (p - 1)
    return messages * 2 ** (sum(n * math.log2(c / n) for c, n in terms) / messages)


def zoo_table(zoo: dict[str, list[Tensor]], ps: Sequence[int] = ZOO_PS) -> dict:
    """For each family: DynamiQ at 5 and 6 bits (single encode, references, rings) and MXFP8-E4M3 at P = 8."""
    out: dict = {}
    for family, grads in zoo.items():
        start = time.perf_counter()
        x = grads[0][: grads[0].numel() // 256 * 256]
        entry: dict = {"coords": grads[0].numel()}
        for bits in (5.0, 6.0):
            single, rate = single_encode(x, bits)
            row = {"single": single, "payload_rate": rate}
            row["rd_bound"], row["oracle"] = gaussian_rd_bound(x, rate), scalar_oracle(x, rate)
            for p in ps:
                total, wire = simulate_all_reduce(grads[:p], codec="dynamiq", bits=bits)
                row[f"ring_p{p}"], row[f"wire_p{p}"] = vnmse(total, exact_sum(grads[:p])), wire
            entry[f"dynamiq {bits:.1f}"] = row
        entry["ring_bound_p8"] = ring_allocation_bound(grads[:8])
        total, wire = simulate_all_reduce(grads[:8], codec="mxfp8")
        entry["mxfp8"] = {"ring_p8": vnmse(total, exact_sum(grads[:8])), "wire_p8": wire}
        entry["seconds"] = time.perf_counter() - start
        out[family] = entry
        print(f"  {family}: {entry['seconds']:.0f} s", flush=True)
    return out


def print_zoo_table(results: dict) -> None:
    headers = [
        "family", "coords", "payload b", "single", "RD bound", "oracle", "/oracle", "/RD",
        "ring P4", "ring P8", "ring P16", "P8/single", "bound", "wire P8", "6.0 P8", "mxfp8 P8", "6.0 < mxfp8",
    ]  # fmt: skip
    lines = []
    for family, e in results.items():
        five, six, mx = e["dynamiq 5.0"], e["dynamiq 6.0"], e["mxfp8"]
        lines.append(
            [
                family,
                f"{e['coords']:,}",
                _num(five["payload_rate"], 2),
                _sci(five["single"]),
                _sci(five["rd_bound"]),
                _sci(five["oracle"]),
                _num(five["single"] / five["oracle"], 2),
                _num(five["single"] / five["rd_bound"], 2),
                *(_sci(five[f"ring_p{p}"]) for p in ZOO_PS),
                _num(five["ring_p8"] / five["single"], 2),
                _num(e["ring_bound_p8"], 2),
                _num(five["wire_p8"], 2),
                _sci(six["ring_p8"]),
                _sci(mx["ring_p8"]),
                "yes" if six["ring_p8"] < mx["ring_p8"] else "NO",
            ]
        )
    print(format_table(headers, lines))
    print(
        "DynamiQ bits=5.0 unless marked. single = vNMSE of one encode of worker 0's gradient; payload b = the payload\n"
        "  bits per coordinate that encode spent (mean group width, side information excluded); RD bound / oracle =\n"
        "  the per-group (32) Gaussian model's rate-distortion bound / best fixed-rate scalar code (Lloyd-Max levels,\n"
        "  widths 0-8 allocated optimally) at that payload rate, side information free (bench/rate_distortion.py).\n"
        f"  Bars: single/oracle <= {ORACLE_BAR}, ring P8/single <= {RING_BAR}, bits=6.0 ring below MXFP8-E4M3's.\n"
        "ring PN = vNMSE of the sum of workers 0..N-1 through an N-rank ring (simulated, same bytes as gloo);\n"
        "bound = the least P8/single any split of the same bits over the ring's messages can reach for a codec whose\n"
        "  error falls 4x per bit, from the family's partial-sum energies (ring_allocation_bound).\n"
        "wire P8 = wire bits per coordinate at P=8, all side information included (the budget is bits=5.0)."
    )


# ---------------------------------------------------------------------------------------------- a'. real gloo run
def run_gloo(rows: list[CodecRow], lm: list[Tensor], timeout: float = 900) -> dict:
    """All-reduces the first 4 LM gradients in 4 real gloo processes (``torch.distributed.run``) with every
    codec; returns ``{label: {bits, identical, seconds, sum}}`` from rank 0, or ``{"_error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="dynamiq-gloo-") as tmp:
        directory = Path(tmp)
        for rank in range(4):
            torch.save(lm[rank].clone(), directory / f"grad{rank}.pt")
        (directory / "rows.json").write_text(json.dumps([asdict(r) for r in rows]))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            "-m", "lightning_fedshard.bench.compression", "--worker", str(directory),
        ]  # fmt: skip
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        start = time.perf_counter()
        # a session of its own, so that a hung run is killed with all four ranks, not just the launcher
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"_error": f"killed after {timeout:.0f} s"}
        if proc.returncode != 0 or not (directory / "result.pt").exists():
            return {"_error": f"exit {proc.returncode}: {output[-3000:]}"}
        results = torch.load(directory / "result.pt")
        results["_seconds"] = time.perf_counter() - start
        return results


def _gloo_worker(directory: Path) -> None:
    """One rank of :func:`run_gloo` (launched by ``torch.distributed.run``)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.load(directory / f"grad{rank}.pt")
    results = {}
    for spec in json.loads((directory / "rows.json").read_text()):
        row = CodecRow(**spec)
        x = local.clone()
        stats = CompressionStats()
        codec = row.make()
        warm_up(codec, x.numel(), world)  # DynamiQ's C kernels: built before the clock starts
        dist.barrier()
        start = time.perf_counter()
        all_reduce(x, codec=codec, min_numel=0, stats=stats)
        seconds = time.perf_counter() - start
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, x)
        # compare bits, not values: -0.0 == 0.0 would hide a difference
        identical = all(torch.equal(g.view(torch.int32), x.view(torch.int32)) for g in gathered)
        if rank == 0:
            results[row.label] = {"bits": stats.bits_per_coord, "identical": identical, "seconds": seconds, "sum": x}
    if rank == 0:
        torch.save(results, directory / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


def merge_gloo(results: dict, gloo: dict, lm: list[Tensor]) -> None:
    """Adds each codec's gloo numbers (and whether they equal the simulation's bit for bit) to ``results``."""
    exact = exact_sum(lm[:4])
    for label, entry in results.items():
        if label.startswith("_") or label not in gloo:
            continue
        g = gloo[label]
        simulated = results["_p4_sums"][label]
        entry["gloo"] = {
            "bits": g["bits"],
            "vnmse": vnmse(g["sum"], exact),
            "replicas_identical": g["identical"],
            "equals_simulation": torch.equal(g["sum"].view(torch.int32), simulated.view(torch.int32)),
            "seconds": g["seconds"],
        }


def print_gloo_table(results: dict, gloo: dict) -> None:
    if "_error" in gloo:
        print(f"real gloo run FAILED: {gloo['_error']}")
        return
    headers = ["codec", "bits sim", "bits gloo", "vNMSE sim", "vNMSE gloo", "replicas identical", "gloo == sim", "s"]
    lines = []
    for label, e in results.items():
        if label.startswith("_") or "gloo" not in e:
            continue
        g = e["gloo"]
        lines.append(
            [
                label,
                _num(e["bits"]["lm_p4"]),
                _num(g["bits"]),
                _sci(e["vnmse"]["lm_p4"]),
                _sci(g["vnmse"]),
                "yes" if g["replicas_identical"] else "NO",
                "bit-exact" if g["equals_simulation"] else "differs",
                _num(g["seconds"], 2),
            ]
        )
    print(format_table(headers, lines))
    print(
        "4 processes (torch.distributed.run, gloo, loopback, 2 cores), first 4 LM workers, all_reduce(min_numel=0).\n"
        "replicas identical: all_gather of the result, compared bit for bit across ranks; gloo == sim: rank 0's\n"
        f"result against simulate_all_reduce's. s = rank 0's time per call (a sanity figure only). "
        f"Whole launch: {gloo.get('_seconds', math.nan):.0f} s."
    )


# ---------------------------------------------------------------------------------------------- b. target check
def target_check(results: dict) -> dict:
    dq, ref = results[TARGET["label"]], results[TARGET["reference"]]
    bits, error, ref_error = dq["bits"]["lm_p8"], dq["vnmse"]["lm_p8"], ref["vnmse"]["lm_p8"]
    passed = bits <= TARGET["bits"] and error <= TARGET["vnmse"] and error < ref_error
    line = (
        f"{'PASS' if passed else 'FAIL'}: DynamiQ bits=5.0, P=8, LM gradients: {bits:.3f} bits/coord (≤ 5.0), "
        f"vNMSE {error:.2e} (≤ 1.0e-03), MXFP8-E4M3 {ref_error:.2e} at {ref['bits']['lm_p8']:.2f} bits "
        f"({ref_error / error:.1f}× DynamiQ's error)"
    )
    print(line)
    return {"pass": passed, "bits": bits, "vnmse": error, "mxfp8_vnmse": ref_error, "line": line}


# ---------------------------------------------------------------------------------------------- c. DAR throughput
def _median_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm-up: allocator, lazy tables, kernel compilation
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def dar_throughput(sizes: Sequence[int], repeats: int) -> list[dict]:
    """Times ``codec.accumulate(msg, local, 1)`` — decode a one-summand message, add the local chunk, encode
    the two-summand sum — and DynamiQ's encode and decode alone, against ``copy_`` of the same fp32 data.
    DynamiQ runs in its C kernels and in its torch reference ("eager"). GB/s = 4·n bytes of fp32 input / time."""
    out = []
    cuda = torch.cuda.is_available()
    for n in sizes:
        x, y = heavy_tailed(2, n, seed=3)
        dst = torch.empty_like(x)
        copy_s = _median_seconds(lambda: dst.copy_(x), repeats)  # noqa: B023 -- called before the loop moves on
        for label, name, bits, eager in (
            ("dynamiq 5.0", "dynamiq", 5.0, False),
            ("dynamiq 5.0 eager", "dynamiq", 5.0, True),
            ("int8", "int8", None, False),
            ("mxfp8", "mxfp8", None, False),
        ):
            with eager_codecs() if eager else contextlib.nullcontext():
                for operation, fn in _operations(make_codec(name, bits), x, y).items():
                    seconds = _median_seconds(fn, repeats)
                    device = "cpu C" if name == "dynamiq" and not eager else "cpu torch"
                    out.append(_rate(device, label, n, seconds, copy_s, operation=operation))
        if cuda:
            out += cuda_dar(x, y, repeats)
    return out


def _operations(codec: Codec, x: Tensor, y: Tensor) -> dict[str, Callable[[], object]]:
    """What the DAR table times for ``codec``: the hop, and for DynamiQ its encode and decode alone."""
    msg = codec.encode(x, 1)
    operations: dict[str, Callable[[], object]] = {"DAR": lambda: codec.accumulate(msg, y, 1)}
    if isinstance(codec, DynamiQCodec):
        operations |= {"encode": lambda: codec.encode(x, 1), "decode": lambda: codec.decode(msg, x.numel(), 1)}
    return operations


def cuda_dar(x: Tensor, y: Tensor, repeats: int) -> list[dict]:
    """The DAR hop of ``x``'s message with local chunk ``y`` on the GPU: the torch codec's decode + add + encode,
    and the Triton kernels (with ``bit_exact``: their bytes equal the torch codec's), against ``copy_`` of the
    same fp32 data in the same run (rows as :func:`dar_throughput`'s)."""
    n = x.numel()
    sync = torch.cuda.synchronize
    xc, yc = x.cuda(), y.cuda()
    dst = torch.empty_like(xc)
    copy_s = _median_seconds(lambda: dst.copy_(xc), repeats, sync)
    codec = DynamiQCodec(5.0)
    msg = codec.encode(xc, 1)
    # the base class's decode + add + encode: DynamiQCodec.accumulate itself may dispatch to Triton on CUDA
    reference = Codec.accumulate(codec, msg, yc, 1)
    torch_s = _median_seconds(lambda: Codec.accumulate(codec, msg, yc, 1), repeats, sync)
    rows = [_rate("cuda torch", "dynamiq 5.0", n, torch_s, copy_s)]
    try:
        # written in parallel with this benchmark; a broken or missing kernel must not cost the CPU sections
        from lightning_fedshard.dynamiq import triton_dar

        fused = triton_dar.dar(codec, msg, yc, 1)
        seconds = _median_seconds(lambda: triton_dar.dar(codec, msg, yc, 1), repeats, sync)
        kernels = _graph_seconds(lambda: triton_dar.dar(codec, msg, yc, 1, check_finite=False))
        copy_kernel = _graph_seconds(lambda: dst.copy_(xc))
        rows.append(
            _rate(
                "cuda triton",
                "dynamiq 5.0",
                n,
                seconds,
                copy_s,
                bit_exact=torch.equal(fused, reference),
                kernel_ms=1e3 * kernels,
                kernel_fraction_of_copy=copy_kernel / kernels,
            )
        )
    except Exception as error:  # noqa: BLE001 -- the table records why the CUDA row failed
        rows.append({"device": "cuda triton", "codec": "dynamiq 5.0", "numel": n, "error": repr(error)[:300]})
    return rows


def _graph_seconds(fn: Callable[[], object]) -> float:
    """Median seconds of ``fn`` replayed as a CUDA graph (``triton.testing.do_bench_cudagraph``): the kernels'
    time without Python's launch overhead, which the whole-call time of ``_median_seconds`` includes."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3


def _rate(
    device: str, label: str, n: int, seconds: float, copy_s: float, operation: str = "DAR", **extra: object
) -> dict:
    gbs, copy_gbs = 4 * n / seconds / 1e9, 4 * n / copy_s / 1e9
    return {
        "device": device,
        "codec": label,
        "operation": operation,
        "numel": n,
        "ms": 1e3 * seconds,
        "gb_per_s": gbs,
        "copy_gb_per_s": copy_gbs,
        "fraction_of_copy": gbs / copy_gbs,
        **extra,
    }


def print_dar_table(rows: list[dict]) -> None:
    headers = ["device / codec", "operation", "n", "ms", "GB/s", "copy_ GB/s", "/copy", "note"]
    lines = []
    for r in rows:
        name = f"{r['device']} {r['codec']}"
        operation = r.get("operation", "DAR")
        if "error" in r:
            lines.append(
                [name, operation, f"2^{r['numel'].bit_length() - 1}", "—", "—", "—", "—", f"skipped: {r['error'][:60]}"]
            )
            continue
        note = "" if "bit_exact" not in r else ("bit-exact vs torch" if r["bit_exact"] else "DIFFERS from torch")
        if "kernel_ms" in r:
            note += f"; kernels {r['kernel_ms']:.3f} ms = {r['kernel_fraction_of_copy']:.2f} of copy_ (CUDA graphs)"
        lines.append(
            [
                name,
                operation,
                f"2^{r['numel'].bit_length() - 1}",
                _num(r["ms"], 2),
                _num(r["gb_per_s"], 3),
                _num(r["copy_gb_per_s"], 2),
                f"{r['fraction_of_copy']:.4f}",
                note,
            ]
        )
    print(format_table(headers, lines))
    print(
        "DAR = codec.accumulate(msg, local, 1): decode a 1-summand message, add the local fp32 chunk, encode the sum.\n"
        "'cpu C' rows run DynamiQ's C kernels (cpu_kernels.c, built once per machine); 'eager' its torch reference.\n"
        "GB/s = 4·n bytes of fp32 input / median time; copy_ = torch copy_ of the same n fp32 in the same run\n"
        "(reads 4n and writes 4n bytes: the memory-bandwidth ceiling). Heavy-tailed input (t3 x block scale).\n"
        f"CPU rows: {torch.get_num_threads()} torch thread(s) (--threads)."
        + ("" if torch.cuda.is_available() else "\nNo CUDA device here: the Triton DAR row is skipped.")
    )


# ---------------------------------------------------------------------------------------------- d. training
class PowerSGDHook:
    """torch's PowerSGD DDP hook with its state inside, so that one CLI override selects it:
    ``--trainer.strategy.init_args.ddp_comm_hook.class_path=lightning_fedshard.bench.compression.PowerSGDHook``.

    ``ddp_comm_state`` is typed ``object`` in ``DDPStrategy``, so LightningCLI cannot build a
    ``PowerSGDState`` there; this callable builds its own on the first bucket (the process group exists by
    then) and ignores the state DDP passes.
    """

    def __init__(self, matrix_approximation_rank: int = 2, start_powerSGD_iter: int = 10) -> None:
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self._state: PowerSGDState | None = None
        # DDP reads a hook's __name__ and __qualname__, which only functions have
        self.__name__ = self.__qualname__ = "powerSGD_hook"

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._state is None:
            self._state = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.matrix_approximation_rank,
                start_powerSGD_iter=self.start_powerSGD_iter,
            )
        # DynamiQDDPStrategy finishes each bucket before the next on CPU, which PowerSGD needs on gloo
        return powerSGD_hook(self._state, bucket)


_CODEC = "--trainer.strategy.init_args.codec="
_HOOK = "--trainer.strategy.init_args.ddp_comm_hook"
TRAINING_RUNS = {
    "none": [f"{_CODEC}none"],
    "bf16": [f"{_CODEC}bf16"],
    "mxfp8": [f"{_CODEC}mxfp8"],
    "dynamiq 5.0": [f"{_CODEC}dynamiq", "--trainer.strategy.init_args.bits=5.0"],
    "powersgd r2": [
        f"{_HOOK}.class_path=lightning_fedshard.bench.compression.PowerSGDHook",
        f"{_HOOK}.init_args.matrix_approximation_rank=2",
        f"{_HOOK}.init_args.start_powerSGD_iter=10",
    ],
    # the GPT-2-style model (tied embeddings, LayerNorm, GELU) through the same recipe
    "gpt2 none": [f"{_CODEC}none", "--model.preset=gpt2-tiny"],
    "gpt2 dynamiq 5.0": [f"{_CODEC}dynamiq", "--trainer.strategy.init_args.bits=5.0", "--model.preset=gpt2-tiny"],
}


def _baseline(label: str) -> str:
    """The uncompressed run a training run is compared with: the one of the same model."""
    return "gpt2 none" if label.startswith("gpt2") else "none"


def training(out: Path, steps: int, config: Path = RECIPE) -> dict:
    results: dict = {}
    out.mkdir(parents=True, exist_ok=True)
    common = [
        f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={min(16, steps)}",
        # a rank that dies mid-collective must fail the others soon, not after the default 30 minutes
        "--trainer.strategy.init_args.timeout=0:05:00",
    ]
    for label, overrides in TRAINING_RUNS.items():
        name = label.replace(" ", "_")
        print(f"  training {label} ({steps} steps) ...", flush=True)
        start = time.perf_counter()
        try:
            result = run_recipe(config, out, [*common, *overrides], name=name)
        except (RuntimeError, FileNotFoundError) as error:
            results[label] = {"error": str(error)[-2000:]}
            print(f"  {label} FAILED: {str(error)[-600:]}")
            continue
        rows = read_metrics(metrics_path(out, name))
        losses = [r["train_loss"] for r in rows.values() if "train_loss" in r]
        bits = [r["dynamiq/gradients/bits_per_coord"] for r in rows.values() if "dynamiq/gradients/bits_per_coord" in r]
        results[label] = {
            "train_loss": sum(losses[-8:]) / len(losses[-8:]),
            "val_loss": result.val_curve[-1]["val_loss"],
            "val_ppl": result.val_ppl,
            "tokens_per_s": result.tokens_per_s,
            "bits_per_coord": sum(bits) / len(bits) if bits else None,
            "val_curve": result.val_curve,
            "seconds": time.perf_counter() - start,
        }
    for label, entry in results.items():
        base = results.get(_baseline(label), {})
        for key in ("train_loss", "val_loss"):
            if key in entry and key in base:
                entry[f"{key}_pct_of_none"] = 100 * entry[key] / base[key]
    return results


def print_training_table(results: dict, steps: int) -> None:
    headers = ["run", "bits/coord", "train loss", "val loss", "val ppl", "tokens/s", "train % none", "val % none"]
    lines = []
    for label, e in results.items():
        if "error" in e:
            lines.append([label, "FAILED", *["—"] * 6])
            continue
        lines.append(
            [
                label,
                _num(e["bits_per_coord"]) if e["bits_per_coord"] is not None else "—",
                _num(e["train_loss"], 4),
                _num(e["val_loss"], 4),
                _num(e["val_ppl"], 3),
                f"{e['tokens_per_s']:.0f}",
                _num(e.get("train_loss_pct_of_none"), 2),
                _num(e.get("val_loss_pct_of_none"), 2),
            ]
        )
    print(format_table(headers, lines))
    print(
        f"{RECIPE} (DDP, 4 CPU processes, gloo), {steps} steps, seed 42. Every run but PowerSGD sums the gradients\n"
        "through the same compressed ring; 'none' is uncompressed fp32 through that ring. train loss = mean of rank\n"
        "0's last 8 logged step losses; val loss/ppl = last validation (all ranks). bits/coord = mean logged\n"
        "dynamiq/gradients/bits_per_coord (PowerSGD rank 2, start_powerSGD_iter=10, logs none: '—').\n"
        "% none = loss / the none run's loss x 100 (gpt2 runs: / the gpt2 none run's; --model.preset=gpt2-tiny).\n"
        "Loopback on 2 cores: tokens/s cannot show a bandwidth win."
    )


# ---------------------------------------------------------------------------------------------- e. plot
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for label, e in results.items():
        if label.startswith("_"):
            continue
        error = e["vnmse"]["lm_p8"]
        if error < 1e-12:
            continue  # lossless codecs sit at fp64 round-off, off any useful scale
        marker = "*" if label.startswith("dynamiq") else "o"
        ax.scatter(e["bits"]["lm_p8"], error, marker=marker, s=90 if marker == "*" else 40)
        # the stochastic DynamiQ row sits just above the deterministic one at the same bits: lift its label
        lifted = e["stochastic"] and label.startswith("dynamiq")
        ax.annotate(
            label,
            (e["bits"]["lm_p8"], error),
            textcoords="offset points",
            xytext=(7, 3 if lifted else 0),
            va="bottom" if lifted else "center",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set(
        xlabel="wire bits per coordinate (side information included)",
        ylabel="vNMSE of the sum",
        title="Ring all-reduce, P=8, tiny-Llama gradients (lossless codecs omitted)",
    )
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedshard bench compression", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/compression"), help="results.json, plot, logs")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer codecs/sizes, P in {4, 8}, no training")
    parser.add_argument("--skip-training", action="store_true", help="skip the tiny-Llama training comparison")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps per training run")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for the simulation and timing sections (training runs are unaffected)",
    )
    parser.add_argument("--dar-only", action="store_true", help="only section c, the DAR throughput against copy_")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank of the gloo run
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        _gloo_worker(args.worker)
        return None
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    # The simulation already runs one Python thread per rank; on a 2-vCPU VM an intra-op pool on top of that
    # made each op wait milliseconds for wake-ups (copy_ of 4 MB: 8-12 ms with 2 threads, 1 ms with 1).
    torch.set_num_threads(args.threads)
    ps = (4, 8) if args.quick else (4, 8, 16)
    lm_workers = max(ps)
    synthetic_numel = 1 << (16 if args.quick else 18)
    rows = codec_rows(args.quick)
    report: dict = {
        "config": {
            "quick": args.quick,
            "ps": list(ps),
            "lm_workers": lm_workers,
            "synthetic_numel": synthetic_numel,
            "seeds": SEEDS,
            "torch": torch.__version__,
            "threads": args.threads,
        }
    }

    if args.dar_only:
        return _dar_section(args, report, start)
    _section(f"inputs: {lm_workers} tiny-Llama gradient workers")
    t = time.perf_counter()
    from lightning_fedshard.bench.gradients import llama_gradients

    lm = llama_gradients(lm_workers)
    print(f"  {lm[0].numel():,} coords each, {time.perf_counter() - t:.0f} s")

    _section("a. codecs: simulated rings")
    results = codec_table(rows, lm, ps, synthetic_numel)
    _section("a. codecs: real 4-process gloo run")
    gloo = run_gloo(rows, lm)
    if "_error" not in gloo:
        merge_gloo(results, gloo, lm)
    report["gloo_error"] = gloo.get("_error")
    results.pop("_p4_sums")
    _section("a. codec table (vNMSE of the sum; bits per coordinate)")
    print_codec_table(results, ps, lm_workers, synthetic_numel)
    print()
    print_gloo_table(results, gloo)
    report["codecs"] = results

    _section("a'. gradient zoo")
    from lightning_fedshard.bench.gradients import gradient_zoo

    t = time.perf_counter()
    zoo = gradient_zoo(max(ZOO_PS), quick=args.quick)
    zoo["gaussian"] = gaussian(max(ZOO_PS), synthetic_numel, seed=1)
    zoo["t3*layer"] = heavy_tailed(max(ZOO_PS), synthetic_numel, seed=2)
    print(f"  {len(zoo)} families, {time.perf_counter() - t:.0f} s")
    report["zoo"] = zoo_table(zoo)
    print_zoo_table(report["zoo"])

    _section("b. target check")
    report["target"] = target_check(results)

    _dar_section(args, report)
    if args.quick or args.skip_training:
        report["training"] = "skipped"
    else:
        _section("d. training: tiny Llama, DDP over the compressed ring")
        report["training"] = training(args.out, args.steps)
        print_training_table(report["training"], args.steps)

    png = args.out / "vnmse_vs_bits.png"
    plot(results, png)
    report["seconds"] = time.perf_counter() - start
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(f"\nplot: {png}\nresults: {args.out / 'results.json'}\ntotal: {report['seconds']:.0f} s")
    return report


def _dar_section(args: argparse.Namespace, report: dict, start: float | None = None) -> dict:
    """Section c; with ``start`` (``--dar-only``) it also writes results.json and ends the run."""
    _section(f"c. DAR throughput ({torch.get_num_threads()} thread)")
    dar = dar_throughput([1 << 20] if args.quick else [1 << 20, 1 << 22], repeats=3 if args.quick else 15)
    print_dar_table(dar)
    report["dar"] = dar
    if start is not None:
        report["seconds"] = time.perf_counter() - start
        (args.out / "results.json").write_text(json.dumps(report, indent=2))
        print(f"\nresults: {args.out / 'results.json'}")
    return report


if __name__ == "__main__":
    main()
