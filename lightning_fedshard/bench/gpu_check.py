"""``fedshard bench gpu-check`` (``make gpu-check``): every GPU check of the package in one run of < 8 minutes.

A GPU is lent now and then, for minutes, to whoever runs this; so each check runs in a process of its own with
its own timeout (a hang or a crash costs that check alone, and the next one still runs), the whole run keeps to
one budget, and a JSON and a Markdown summary are written to ``--out`` (default ``$OUT``, else ``./runs/gpu-check``:
every ``fedshard bench`` writes under ``./runs``) whatever happens. Without CUDA nothing runs: the summary says the
run was skipped and the exit status is 0.

Checks (:data:`CHECKS`), each with a pass/fail line, its figure and the peak CUDA memory of its process:

- ``pytest``: ``pytest -m cuda`` over the test files that hold GPU tests (Triton DAR compiled, bit-exact for every
  width mix; DynamiQ collectives on CUDA tensors through gloo; the strategies' bf16 paths; the verifier's bounds
  on CUDA against the CPU; Llama forward/backward in bf16);
- ``dar``: Triton DAR GB/s of fp32 input against the GPU's own ``copy_`` in the same process;
- ``llama`` / ``llama-compile`` / ``llama-float8``: Llama 3.1 1B (``llama3.1-1b``), bf16-mixed under ``fsdp2`` on
  one GPU, fused AdamW, eager, with every block compiled, and compiled with the blocks' linear layers in float8:
  tokens/s and MFU against the dense bf16 peak (:data:`H200_BF16_PEAK`, the datasheet's) and against a bf16
  matrix product timed in the same process, the warm-up (compilation) apart;
- ``llama-8b``: Llama 3.1 8B in bf16 with AdamW8bit and activation checkpointing: real optimizer steps on one GPU,
  tokens/s, MFU, the memory estimate against the peak;
- ``dynamiq-step``: what DynamiQ's compression costs one rank of an 8-rank ring per step of Llama 3.1 1B's gradients
  (DDP's 25 MiB buckets, messages looped back on the GPU; ``fedshard bench dynamiq-step``), against bf16;
- ``verify``: VNN-COMP instances of mnist_fc 256x6, acasxu and a verivital conv net on CUDA and on the CPU, same
  verdicts, time per instance side by side, and where ``--device auto`` puts each (the benchmark files come from
  ``--vnncomp``, ``$FEDSHARD_VNNCOMP``, ``./.vnncomp`` or ``../shared/vnncomp``).

Example::

    python -m lightning_fedshard.bench.gpu_check --out /tmp/gpu      # or: make gpu-check OUT=/tmp/gpu
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a script (scripts/gpu_check.sh does, so that a run without CUDA needs no more than torch): this folder
    # must not shadow top-level modules (its compression.py, recipes.py, ...) for the packages the checks import.
    sys.path.pop(0)

__all__ = [
    "CHECKS",
    "H200_BF16_PEAK",
    "Check",
    "CheckResult",
    "main",
    "run_checks",
    "skipped_summary",
    "write_summary",
]

REPO = Path(__file__).resolve().parents[2]
MODULE = "lightning_fedshard.bench.gpu_check"  # not __name__, which is "__main__" when run with -m
#: The whole run's budget: the lease's commands end at 10 minutes, the issue asks for under 8.
DEFAULT_BUDGET_S = 450.0
#: Seconds kept back for the summary after the last check, and the least a check is started with.
RESERVE_S = 5.0
MIN_CHECK_S = 20.0
#: Dense bf16 tensor-core peak of an H100/H200 SXM by NVIDIA's datasheet (989.4 TFLOP/s without sparsity).
H200_BF16_PEAK = 989.4e12
SUMMARY_JSON, SUMMARY_MD, LOG = "gpu_check.json", "gpu_check.md", "gpu_check.log"


@dataclass(frozen=True)
class Check:
    """One check: ``target`` (``"module:function"``, called with ``kwargs`` in a process of its own, returning a
    dict with ``status`` (``pass``/``fail``), ``figure`` (one line) and ``details``) and its timeout."""

    name: str
    target: str
    timeout_s: float
    description: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class CheckResult:
    """How one check ended: ``pass``, ``fail``, ``timeout``, ``error`` (the process crashed or returned nothing)
    or ``skipped`` (not started: the budget was spent), with its figure and the peak CUDA memory of its process."""

    name: str
    status: str
    figure: str = ""
    seconds: float = 0.0
    peak_cuda_bytes: int | None = None
    details: dict | list | None = None
    reason: str = ""
    description: str = ""


#: The 1B's runs: 4 warm-up steps (compilation) and 6 timed, 4 × 2048 tokens each.
LLAMA_1B = {"steps": 10, "warmup": 4}
#: The 8B on one GPU: bf16 parameters and gradients (16 + 16 GB) and AdamW8bit's 2-byte moments (16 GB), blocks
#: recomputed, 2 × 2048 tokens: 58 GiB by :func:`llama_memory_estimate` (fp32 parameters would need 88 GiB).
LLAMA_8B = {
    "preset": "llama3.1-8b",
    "precision": "bf16-true",
    "optimizer": "adamw8bit",
    "checkpointing": True,
    "batch": 2,
    "steps": 5,
    "warmup": 2,
}
CHECKS: tuple[Check, ...] = (
    Check("pytest", f"{MODULE}:pytest_cuda", 160.0, "pytest -m cuda (GPU tests across the package)"),
    Check("dar", f"{MODULE}:dar_throughput", 35.0, "Triton DAR GB/s against copy_ GB/s"),
    # Llama 3.1 1B eager, compiled and compiled in float8: the same batch, seq_len and steps, comparable; each
    # compiles in its own process (warm-up included in the timeout). The 8B runs with activation checkpointing.
    Check("llama", f"{MODULE}:llama_throughput", 25.0, "Llama 3.1 1B, bf16-mixed, fsdp2 world size 1", LLAMA_1B),
    Check(
        "llama-compile",
        f"{MODULE}:llama_throughput",
        50.0,
        "the same, every TransformerBlock compiled",
        {**LLAMA_1B, "compile": True},
    ),
    Check(
        "llama-float8",
        f"{MODULE}:llama_throughput",
        50.0,
        "the same compiled, the blocks' linear layers in float8 (torchao)",
        {**LLAMA_1B, "compile": True, "float8": True},
    ),
    Check(
        "llama-8b",
        f"{MODULE}:llama_throughput",
        35.0,
        "Llama 3.1 8B, bf16-true, AdamW8bit, activation checkpointing",
        LLAMA_8B,
    ),
    # the instances stop starting 10 s before the check's timeout (see verify_cuda_vs_cpu)
    Check("verify", f"{MODULE}:verify_cuda_vs_cpu", 65.0, "the verifier on CUDA against the CPU", {"budget_s": 55.0}),
    # the timed rounds of the 3 paths stop at budget_s (10 s): with the imports, 6 GB of gradients and the warm-ups
    # (Triton's compile), 28 s, which keeps the checks' timeouts under the 8 minutes
    Check("dynamiq-step", f"{MODULE}:dynamiq_step", 28.0, "DynamiQ's per-rank compute per 1B step vs bf16"),
)


def check_timeout_s(
    check: Check, remaining_s: float, reserve_s: float = RESERVE_S, min_check_s: float = MIN_CHECK_S
) -> float | None:
    """The timeout ``check`` runs with when ``remaining_s`` of the run's budget are left: its own, cut to what is
    left after ``reserve_s``; ``None`` (not started) when that is under ``min_check_s``.

    >>> check_timeout_s(Check("x", "m:f", 60.0, ""), remaining_s=40.0)
    35.0
    """
    timeout = min(check.timeout_s, remaining_s - reserve_s)
    return timeout if timeout >= min_check_s else None


def run_checks(
    checks: Sequence[Check],
    budget_s: float,
    log: Path,
    reserve_s: float = RESERVE_S,
    min_check_s: float = MIN_CHECK_S,
) -> list[CheckResult]:
    """Runs ``checks`` one after another, each in its own process session with its own timeout, within
    ``budget_s`` seconds in all; their output goes to ``log``. A check that fails, crashes or times out is recorded
    and the next one runs; those the budget leaves no time for are ``skipped``."""
    deadline = time.monotonic() + budget_s
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch, open(log, "a") as out:
        for check in checks:
            timeout = check_timeout_s(check, deadline - time.monotonic(), reserve_s, min_check_s)
            if timeout is None:
                results.append(CheckResult(check.name, "skipped", reason="the run's time budget was spent"))
            else:
                results.append(_run_one(check, timeout, Path(scratch) / f"{check.name}.json", out))
            results[-1].description = check.description
            print(_line(results[-1]), flush=True)
    return results


def _run_one(check: Check, timeout: float, result_path: Path, out) -> CheckResult:
    out.write(f"\n===== {check.name} ({check.target}, timeout {timeout:.0f} s)\n")
    out.flush()
    # the module as a script: a check imports what it needs, not the whole package
    command = [sys.executable, str(Path(__file__).resolve()), "--child", check.target, "--result", str(result_path)]
    command += ["--kwargs", json.dumps(check.kwargs)] if check.kwargs else []
    start = time.monotonic()
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]  # the checks run this working tree
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the check and anything it started
        proc.wait()
        out.write(f"\n===== {check.name}: killed after {timeout:.0f} s\n")
        seconds = time.monotonic() - start
        return CheckResult(check.name, "timeout", seconds=seconds, reason=f"killed after {timeout:.0f} s")
    seconds = time.monotonic() - start
    try:
        record = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return CheckResult(check.name, "error", seconds=seconds, reason=f"exit status {code}, no result (see {LOG})")
    return CheckResult(
        check.name,
        record.get("status", "error"),
        record.get("figure", ""),
        seconds,
        record.get("peak_cuda_bytes"),
        record.get("details"),
        record.get("reason", ""),
    )


def _child(target: str, result_path: Path, kwargs: dict) -> int:
    """In the check's own process: call ``target(**kwargs)``, write what it returned (or the error) with the
    process's peak CUDA memory."""
    module, function = target.split(":")
    try:
        record = dict(getattr(importlib.import_module(module), function)(**kwargs))
    except Exception as error:  # noqa: BLE001 -- the summary records why the check failed
        traceback.print_exc()
        record = {"status": "fail", "reason": f"{type(error).__name__}: {error}"[:500]}
    record["peak_cuda_bytes"] = _peak_cuda_bytes()
    result_path.write_text(json.dumps(record, default=str))
    return 0


def _peak_cuda_bytes() -> int | None:
    torch = sys.modules.get("torch")  # a check that never imported torch used no GPU
    if torch is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.max_memory_allocated())


# ------------------------------------------------------------------------------------------------- summaries
def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.2f} GiB"


def _line(result: CheckResult) -> str:
    note = f"  [{result.reason}]" if result.reason else ""
    memory = f"  peak {_gib(result.peak_cuda_bytes)}" if result.peak_cuda_bytes is not None else ""
    return f"{result.status.upper():7s} {result.name}: {result.figure}{memory}  ({result.seconds:.1f} s){note}"


def write_summary(out_dir: Path, results: list[CheckResult], meta: dict) -> int:
    """Writes ``gpu_check.json`` and ``gpu_check.md`` to ``out_dir``; returns the exit status (0 when every check
    passed or the run was skipped for want of CUDA, else 1)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = all(r.status == "pass" for r in results) if results else meta.get("skipped", False)
    summary = {**meta, "ok": bool(ok), "checks": [asdict(r) for r in results]}
    (out_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    lines = [f"# GPU check, {meta.get('date', '')}", ""]
    lines += ["**Skipped**: nothing was run." if meta.get("skipped") else f"**{'All passed' if ok else 'FAILED'}**", ""]
    lines += [f"- {key}: {meta[key]}" for key in ("machine", "torch", "triton", "cuda", "reason") if meta.get(key)]
    if results:
        lines += ["", "| check | status | figure | peak CUDA memory | seconds |", "|---|---|---|---|---|"]
        for r in results:
            figure = r.figure + (f" ({r.reason})" if r.reason else "")
            lines.append(f"| {r.name} | {r.status} | {figure} | {_gib(r.peak_cuda_bytes)} | {r.seconds:.1f} |")
        for r in results:
            if isinstance(r.details, list) and r.details and isinstance(r.details[0], dict):
                lines += ["", f"## {r.name}: {r.description}", "", *_markdown_table(r.details)]
    (out_dir / SUMMARY_MD).write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


def _markdown_table(rows: list[dict]) -> list[str]:
    headers = list(dict.fromkeys(key for row in rows for key in row))
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    body = ["| " + " | ".join(cell(row.get(h, "")) for h in headers) + " |" for row in rows]
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *body]


def _meta() -> dict:
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": sys.executable}
    try:
        import torch
    except ImportError:
        return {**meta, "torch": "not installed", "cuda": "none"}
    meta["torch"] = torch.__version__
    meta["cuda"] = torch.version.cuda or "none"
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = "not installed"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        meta["machine"] = f"{len(names)} × {names[0]}"
    return meta


def skipped_summary(out_dir: Path, reason: str) -> int:
    """The summary of a run that checked nothing (no CUDA here); exit status 0."""
    return write_summary(out_dir, [], {**_meta(), "skipped": True, "reason": reason})


# ------------------------------------------------------------------------------------------------ the checks
def cuda_test_files(root: Path = REPO / "tests") -> list[Path]:
    """The test files that hold tests marked ``cuda`` (collected alone, so that modules needing packages the GPU
    machine lacks are never imported)."""
    marker = "pytest.mark." + "cuda"  # not itself a match for this scan
    return sorted(p for p in root.rglob("test_*.py") if marker in p.read_text(encoding="utf-8"))


def junit_outcome(junit: Path, exit_code: int) -> dict:
    """A check result from pytest's JUnit XML and exit code: counts over every test suite, the failing tests."""
    from xml.etree import ElementTree

    root = ElementTree.parse(junit).getroot()
    suites = list(root.iter("testsuite"))  # a list: each count below walks them again
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing = [
        {"test": f"{case.get('classname')}::{case.get('name')}", "message": (problem.get("message") or "")[:200]}
        for case in root.iter("testcase")
        for problem in [*case.iter("failure"), *case.iter("error")]
    ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figure = f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    if exit_code not in (0, 1):  # interrupted, internal error, usage error: the counts stop where pytest did
        figure += f", pytest exit code {exit_code}"
    status = "pass" if exit_code == 0 and passed > 0 else "fail"
    return {"status": status, "figure": figure, "details": failing[:20]}


def pytest_cuda() -> dict:
    import pytest

    files = cuda_test_files()
    if not files:  # pytest given no files would run the whole suite
        return {"status": "fail", "figure": "no test files with GPU tests found", "reason": str(REPO / "tests")}
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        code = pytest.main(["-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *map(str, files)])
        outcome = junit_outcome(junit, int(code))
    return {**outcome, "figure": f"{outcome['figure']} in {len(files)} files"}


def dar_throughput() -> dict:
    import torch

    from lightning_fedshard.bench.compression import cuda_dar, heavy_tailed

    rows = []
    for n in (1 << 24, 1 << 25):  # 64 and 128 MiB of fp32: past the 60 MB L2
        x, y = heavy_tailed(2, n, seed=3)
        rows += cuda_dar(x, y, repeats=10)
        torch.cuda.empty_cache()
    triton_rows = [r for r in rows if r.get("device") == "cuda triton"]
    errors = [r["error"] for r in triton_rows if "error" in r]
    if errors or not triton_rows:
        return {"status": "fail", "figure": "Triton DAR failed", "reason": "; ".join(errors)[:500], "details": rows}
    best = max(triton_rows, key=lambda r: r["numel"])
    exact = all(r["bit_exact"] for r in triton_rows)
    figure = (
        f"{best['gb_per_s']:.1f} GB/s at n=2^{best['numel'].bit_length() - 1} vs copy_ {best['copy_gb_per_s']:.1f} GB/s"
        f" ({best['fraction_of_copy']:.2f}×; kernels alone {best['kernel_fraction_of_copy']:.2f}× of copy_'s, both as"
        f" CUDA graphs), bit-exact: {exact}"
    )
    return {"status": "pass" if exact else "fail", "figure": figure, "details": rows}


def bf16_matmul_flops(size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of a ``size``³ bf16 matrix product on random data here (after warm-up): the GPU's own ceiling."""
    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3)


def llama_throughput(
    checkpointing: bool = False,
    preset: str = "llama3.1-1b",
    steps: int = 14,
    warmup: int = 4,
    batch: int = 4,
    seq_len: int = 2048,
    accelerator: str = "cuda",
    compile: bool = False,
    float8: bool = False,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
) -> dict:
    """``preset`` trained ``steps`` steps (``batch`` × ``seq_len`` random tokens, seed 0) in ``precision`` under
    ``fsdp2`` on one GPU with ``optimizer`` (AdamW fused); ``compile`` compiles every ``TransformerBlock``, ``float8``
    trains their linear layers in float8. Tokens/s and MFU over the steps after ``warmup`` (whose seconds, compilation
    included, are given apart), the losses, the dtype of the first block's output, the memory estimate of
    :func:`llama_memory_estimate`. (``accelerator="cpu"``: the same run on the CPU, gloo, for checking the check.)"""
    cuda = accelerator == "cuda"
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_fedshard import FLFSDPStrategy, LlamaPretraining

    class StepTimer(pl.Callback):
        """Wall time of the first ``warmup`` steps and of those after (CUDA synchronised at each end)."""

        def __init__(self) -> None:
            self.timed, self.start, self.seconds, self.warmup_seconds = 0, 0.0, float("nan"), float("nan")
            self.losses: list[float] = []
            self.compute_dtypes: list[str] = []

        def on_train_start(self, trainer, module) -> None:
            # the block's own output: a hook inside a compiled forward would be traced into it
            module.model.layers[0].register_forward_hook(lambda _, a, out: self.compute_dtypes.append(str(out.dtype)))
            self.start = time.perf_counter()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                _synchronize(cuda)
                self.warmup_seconds = time.perf_counter() - self.start
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
            if batch_idx >= warmup:
                _synchronize(cuda)
                self.timed, self.seconds = batch_idx - warmup + 1, time.perf_counter() - self.start

    pl.seed_everything(0, verbose=False)
    module = LlamaPretraining(preset, seq_len=seq_len, warmup_fraction=0.5, optimizer=optimizer, float8=float8)
    estimate = llama_memory_estimate(module.config, precision, optimizer, batch, seq_len, checkpointing)
    print(f"llama_throughput {preset}: memory estimate {estimate}", flush=True)
    tokens = torch.randint(0, module.config.vocab_size, (batch * steps, seq_len + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    timer = StepTimer()
    blocks = ["lightning_fedshard.models.llama.TransformerBlock"]
    strategy = FLFSDPStrategy(
        num_groups=1,
        auto_wrap=blocks,
        activation_checkpointing=blocks if checkpointing else None,
        compile=blocks if compile else None,
    )
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    groups = trainer.optimizers[0].param_groups
    fused = all(group.get("fused", False) for group in groups)
    measured = timer.timed * batch * seq_len / timer.seconds
    flops = module.config.flops_per_token(seq_len) * measured
    matmul = bf16_matmul_flops() if cuda else float("nan")
    details = [
        {
            "preset": preset,
            "precision": precision,
            "compiled": compile,
            "float8": float8,
            "activation checkpointing": checkpointing,
            "optimizer": f"{type(trainer.optimizers[0]).__name__}{' (fused)' if fused else ''}",
            "batch × seq_len": f"{batch} × {seq_len}",
            "tokens/s": round(measured),
            "model TFLOP/s": flops / 1e12,
            "MFU vs 989.4 TFLOP/s (datasheet)": flops / H200_BF16_PEAK,
            "bf16 matmul TFLOP/s here": matmul / 1e12,
            "MFU vs that matmul": flops / matmul,
            "warm-up s": timer.warmup_seconds,
            "memory estimate GiB": estimate["total"],
            "compute dtype": ",".join(sorted(set(timer.compute_dtypes))),
            "first loss": timer.losses[0],
            "last loss": timer.losses[-1],
            "losses": timer.losses,
        }
    ]
    fused_ok = fused or not (cuda and optimizer == "adamw")
    ok = fused_ok and all(math.isfinite(loss) for loss in timer.losses) and len(timer.losses) == steps
    figure = f"{measured:,.0f} tokens/s, MFU {flops / H200_BF16_PEAK:.1%} of 989 TFLOP/s"
    figure += f" ({flops / matmul:.1%} of the bf16 matmul measured here), warm-up {timer.warmup_seconds:.0f} s"
    return {"status": "pass" if ok else "fail", "figure": figure, "details": details}


def dynamiq_step(
    preset: str = "llama3.1-1b", world_size: int = 8, steps: int = 3, budget_s: float = 10.0, device: str = "cuda"
) -> dict:
    """``fedshard bench dynamiq-step`` on ``preset``'s DDP gradient buckets (random values of its parameters'
    sizes): ms per step that one rank of a ``world_size``-rank ring computes with DynamiQ at 5 bits, against the
    same ring with bf16 messages and against ``bf16_compress_hook``'s cast. (``device="cpu"``, a small preset: the
    same on the CPU, for checking the check.)"""
    from lightning_fedshard.bench.dynamiq_step import step_costs

    result = step_costs(preset, world_size, device=device, steps=steps, budget_s=budget_s)
    rows = {row["path"]: row for row in result["rows"]}
    dynamiq, ring, cast = (rows[name]["ms_per_step"] for name in ("dynamiq", "bf16 ring", "bf16 cast"))
    figure = (
        f"DynamiQ {dynamiq:.1f} ms/step vs bf16 ring {ring:.1f} ms ({dynamiq / ring:.2f}×), bf16 cast {cast:.1f} ms;"
        f" {result['coordinates'] / 1e6:,.0f}M coordinates in {result['buckets']} buckets, one rank of {world_size}"
    )
    ok = all(math.isfinite(row["ms_per_step"]) and row["timed_steps"] >= 1 for row in result["rows"])
    return {"status": "pass" if ok else "fail", "figure": figure, "details": result["rows"], "run": result}


def llama_memory_estimate(
    config, precision: str, optimizer: str, batch: int, seq_len: int, checkpointing: bool
) -> dict[str, float]:
    """GiB one GPU holds training ``config`` alone (FSDP2 over one rank): parameters and gradients (fp32 under
    ``bf16-mixed``, bf16 under ``bf16-true``), the optimizer's state (AdamW: two moments of the parameters' dtype;
    AdamW8bit: two bytes and 8 bytes of scales per 128 coordinates, plus the fp32 temporaries of one piece of its
    step), the bf16 copies FSDP2 gathers (embedding and output head from forward to backward, two blocks at a
    time with their unsharded gradients), and the logits (bf16, their fp32 copy and log-softmax, their gradient).
    Activations are counted under per-block checkpointing only (each block's bf16 input, and one block's
    recomputed activations, about 16·dim + 4·ffn_dim values a token); without it they are left out."""
    from lightning_fedshard.optim.adamw8bit import PIECE_NUMEL

    n, gib = config.num_parameters, 2**30
    weight_bytes = 2 if precision.startswith("bf16-true") else 4
    block = (n - 2 * config.vocab_size * config.dim - config.dim) / config.n_layers
    if optimizer == "adamw8bit":
        state = n * (2 + 8 / 128) + 11 * 4 * min(PIECE_NUMEL, config.vocab_size * config.dim)
    else:
        state = 2 * weight_bytes * n
    gathered = 2 * (2 * config.vocab_size * config.dim + 2 * 2 * block)
    tokens = batch * seq_len
    logits = tokens * config.vocab_size * (2 + 4 + 4 + 4)
    activations = float("nan")
    if checkpointing:
        activations = 2 * tokens * (config.n_layers * config.dim + 16 * config.dim + 4 * config.ffn_dim)
    parts = {
        "parameters": weight_bytes * n,
        "gradients": weight_bytes * n,
        "optimizer": state,
        "gathered": gathered,
        "logits": logits,
        "activations": activations,
    }
    known = sum(v for v in parts.values() if math.isfinite(v))
    return {**{k: round(v / gib, 2) for k, v in parts.items()}, "total": round(known / gib, 1)}


def _synchronize(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def vnncomp_root(given: str | None = None) -> Path | None:
    """The folder holding ``mnist_fc_2022`` and ``acasxu_2022``: ``given``, ``$FEDSHARD_VNNCOMP``, ``./.vnncomp``
    (where a GPU run carries them) or ``../shared/vnncomp``; ``None`` if none has them."""
    candidates = [given, os.environ.get("FEDSHARD_VNNCOMP"), REPO / ".vnncomp", REPO.parent / "shared" / "vnncomp"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "mnist_fc_2022").is_dir():
            return Path(candidate)
    return None


#: Instances of the CPU benchmark (docs/benchmarks.md) that decide well within 60 s on one core of the development
#: machine (measured there with a 10 s timeout, loading included): mnist_fc 256x6 at ε = 0.03 (CROWN 1.2–1.7 s,
#: α-CROWN 2.0 and 9.5 s, PGD 0.3 s) and acasxu across its property families (input splitting 3–7 s, PGD 0.2 s);
#: then a conv net with max pooling, verivital's Convnet_maxpool (CROWN through patches, 6 s on one loaded core at
#: a 30 s timeout), last and with a shorter timeout: it starts while the budget has room for its two runs.
#: ``(set, onnx, vnnlib, timeout in seconds per device)``.
VERIFY_INSTANCES = tuple(
    [("mnist_fc_2022", "onnx/mnist-net_256x6.onnx", f"vnnlib/prop_{p}_0.03.vnnlib", 20.0) for p in (0, 2, 3, 6, 12)]
    + [
        ("acasxu_2022", f"onnx/ACASXU_run2a_{net}_batch_2000.onnx.gz", f"vnnlib/prop_{p}.vnnlib", 20.0)
        for net, p in (("1_1", 1), ("1_2", 2), ("1_1", 4), ("1_9", 7), ("1_1", 10))
    ]
    + [("verivital_2021", "onnx/Convnet_maxpool.onnx.gz", "vnnlib/maxpool_specs/prop_2_0.004.vnnlib", 10.0)]
)


def _warm_cuda() -> None:
    """The CUDA context, cuBLAS, cuDNN's convolutions and the autograd engine's CUDA thread, untimed: the first
    instance that needs each would otherwise pay for it."""
    import torch
    import torch.nn.functional as F

    x = torch.ones(2, 3, 8, 8, device="cuda", requires_grad=True)
    weight = torch.ones(4, 3, 3, 3, device="cuda")
    y = F.conv2d(x, weight) @ torch.ones(6, 6, device="cuda")
    F.conv_transpose2d(y.detach(), weight)
    y.sum().backward()
    torch.cuda.synchronize()


def _phases(result) -> str:
    """Where an instance's time went: ``phase seconds`` for each phase that took any."""
    return " ".join(f"{phase} {seconds:.2f}" for phase, seconds in result.times.items() if seconds >= 0.005)


@contextmanager
def _one_cpu_thread(active: bool) -> Iterator[None]:
    """torch computes on one thread inside the block when ``active`` (the GPU machine's CPU has 16 cores)."""
    import torch

    saved = torch.get_num_threads()
    if active:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def verify_cuda_vs_cpu(
    root: str | None = None,
    budget_s: float = 60.0,
    devices: tuple[str, str] = ("cuda", "cpu"),
    instances: tuple[tuple[str, str, str, float], ...] = VERIFY_INSTANCES,
) -> dict:
    """Each of ``instances`` verified on ``devices[0]`` (CUDA) and ``devices[1]`` (the CPU), same config: no sat/unsat
    contradiction, how many verdicts are the same, the time per instance side by side with what decided it and the
    phases' times; and where ``--device auto`` puts the instance
    (:func:`~lightning_fedshard.verify.device.resolve_device` on the loaded net), with its time against the CPU's:
    that of the device it picks, whose run it would be (the target: none slower than on the CPU). The CPU runs on
    one thread (the target is CUDA against one core). An instance
    starts only while ``budget_s`` leaves room for both of its runs at their timeout; the others are listed as not
    run. (``devices=("auto", "cpu")`` checks the check on a CPU.)"""
    import importlib.util

    import torch

    from lightning_fedshard.verify import VerifyConfig, load_onnx, verify_files
    from lightning_fedshard.verify.config import Refine
    from lightning_fedshard.verify.device import bound_pass_flops, resolve_device

    folder = vnncomp_root(root)
    if folder is None:
        return {"status": "fail", "figure": "no VNN-COMP files", "reason": "copy ../shared/vnncomp to ./.vnncomp"}
    # MILP refinement needs highspy; where the machine lacks it both devices run without it (said in the table)
    refine = Refine.AUTO if importlib.util.find_spec("highspy") is not None else Refine.NONE
    if torch.cuda.is_available():
        _warm_cuda()
    deadline, rows = time.monotonic() + budget_s, []
    for benchmark, onnx, vnnlib, timeout in instances:
        net = Path(onnx).name.split(".")[0].replace("_batch_2000", "")
        row = {"instance": f"{net} {Path(vnnlib).stem}", "refine": refine.value}
        if time.monotonic() + 2 * timeout > deadline:
            rows.append({**row, "note": "not run: budget"})
            continue
        files = folder / benchmark / onnx, folder / benchmark / vnnlib
        graph = load_onnx(files[0])
        auto = resolve_device("auto", local_rank=0, graph=graph)
        row["pass GFLOP"], row["auto"] = round(bound_pass_flops(graph) / 1e9, 3), str(auto)
        for device in devices:
            config = VerifyConfig(timeout=timeout, device=device, refine=refine)
            with _one_cpu_thread(device == "cpu"):  # the target compares CUDA with one CPU core
                result = verify_files(*files, config)
            row[f"{device} verdict"], row[f"{device} by"] = result.verdict.value, result.decided_by
            row[f"{device} s"], row[f"{device} phases"] = sum(result.times.values()), _phases(result)
        answers = {row[f"{devices[0]} verdict"], row[f"{devices[1]} verdict"]}
        row["same"], row["contradiction"] = len(answers) == 1, answers == {"sat", "unsat"}
        row["auto pick s"] = row[f"{devices[0] if auto.type == 'cuda' else devices[1]} s"]
        rows.append(row)
    run = [r for r in rows if "same" in r]
    same, contradictions = sum(r["same"] for r in run), sum(r["contradiction"] for r in run)

    def median_ratio(device: str) -> float:
        ratios = sorted(r[f"{devices[1]} s"] / r[f"{device} s"] for r in run if r[f"{device} s"] > 0)
        return ratios[len(ratios) // 2] if ratios else float("nan")

    slower = [r["instance"] for r in run if r["auto pick s"] > r[f"{devices[1]} s"]]
    figure = f"{same}/{len(run)} same verdict, {contradictions} sat/unsat contradictions, median"
    figure += f" {devices[1]}/{devices[0]} time {median_ratio(devices[0]):.2f}×,"
    figure += f" {devices[1]}/auto {median_ratio('auto pick'):.2f}×"
    figure += f"; auto on cuda for {sum(r['auto'].startswith('cuda') for r in run)}, slower than {devices[1]}: "
    figure += ", ".join(slower) if slower else "none"
    # A sat on one device and a timeout on the other is the deadline's doing (the attack's share of the timeout),
    # not the device's; sat against unsat would be a soundness bug, and each sat's counterexample was replayed.
    return {"status": "pass" if run and not contradictions else "fail", "figure": figure, "details": rows}


# ------------------------------------------------------------------------------------------------- entry point
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedshard bench gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="summary folder (default $OUT, else ./runs/gpu-check)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all checks")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run these checks alone")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # module:function, in a check's own process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kwargs", help=argparse.SUPPRESS)  # JSON keyword arguments of --child
    return parser


def main(argv: list[str] | None = None, cuda_available: Callable[[], bool] | None = None) -> int:
    """Runs the checks (or, without CUDA, writes the skipped summary); returns the exit status."""
    args = _parser().parse_args(argv)
    if args.child:
        return _child(args.child, args.result, json.loads(args.kwargs or "{}"))
    out = args.out or Path(os.environ.get("OUT") or "runs/gpu-check")
    try:
        import torch
    except ImportError:  # an interpreter without torch has no CUDA to check either
        print(f"gpu-check: skipped, torch is not installed for {sys.executable} (nothing was run)")
        return skipped_summary(out, f"torch is not installed for {sys.executable}: nothing was run")
    if not (cuda_available or torch.cuda.is_available)():
        print("gpu-check: skipped, CUDA is not available on this machine (nothing was run)")
        return skipped_summary(out, "CUDA is not available on this machine: nothing was run")
    out.mkdir(parents=True, exist_ok=True)
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    start = time.monotonic()
    results = run_checks(checks, args.budget, out / LOG)
    status = write_summary(out, results, {**_meta(), "seconds": round(time.monotonic() - start, 1)})
    print(f"gpu-check: {'all passed' if status == 0 else 'FAILED'}; summary in {out / SUMMARY_MD}")
    return status


if __name__ == "__main__":
    sys.exit(main())
