"""``fedshard verify``: one instance (ONNX + VNN-LIB) or a whole VNN-COMP ``instances.csv``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from lightning_fedshard.verify.config import BabMode, Method, Refine, VerifyConfig
from lightning_fedshard.verify.instances import (
    Instance,
    InstanceResult,
    read_expected,
    read_instances,
    read_results,
    reference_results,
    run_instances,
    score_answer,
    select_instances,
    summarise,
    write_results,
)
from lightning_fedshard.verify.shard.plan import Strategy, TensorParallelMode
from lightning_fedshard.verify.spec import Counterexample, write_result
from lightning_fedshard.verify.verifier import REPORT_FIELDS, verify_files

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedshard verify",
        description="Verify ONNX networks against VNN-LIB properties (IBP, CROWN, α-CROWN, β-CROWN BaB).",
        epilog="examples:\n  fedshard verify net.onnx prop.vnnlib --timeout 120 --result out.txt --report r.json\n"
        "  fedshard verify --instances mnist_fc/instances.csv --results results.csv\n"
        "  fedshard verify net.onnx prop.vnnlib --strategy fsdp --devices 2 --report r.json\n"
        "  fedshard verify --instances mnist_fc/instances.csv --strategy tp --devices 4 --group-size 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("onnx", nargs="?", help="ONNX model (.onnx or .onnx.gz)")
    parser.add_argument("vnnlib", nargs="?", help="VNN-LIB property (.vnnlib or .vnnlib.gz)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default 120; per instance from the CSV)")
    parser.add_argument("--result", type=Path, help="write the VNN-COMP result file here")
    parser.add_argument("--report", type=Path, help="write root bounds, deciding method, times and memory as JSON")
    parser.add_argument("--instances", type=Path, help="a VNN-COMP instances.csv (onnx,vnnlib,timeout rows)")
    parser.add_argument("--results", type=Path, help="with --instances: one CSV row per instance")
    parser.add_argument(
        "--expected", type=Path, help="with --instances: expected verdicts CSV (default: expected_verdicts.csv beside)"
    )
    parser.add_argument(
        "--summarise", nargs="+", type=Path, metavar="RESULTS", help="print the tables of earlier --results files"
    )
    parser.add_argument("--limit", type=int, help="with --instances: only the first N instances")
    parser.add_argument(
        "--by",
        choices=["network", "property"],
        default="network",
        help="with --instances/--summarise: one table row per network (default) or per VNN-LIB property",
    )
    parser.add_argument("--networks", nargs="+", help="with --instances: only the rows of these ONNX file names")
    parser.add_argument("--method", choices=[m.value for m in Method], default=Method.BETA_CROWN.value)
    parser.add_argument(
        "--bab",
        choices=[m.value for m in BabMode],
        default=BabMode.AUTO.value,
        help="branch-and-bound splits ReLUs (relu), the input box (input), or chooses (auto: the input box of "
        "networks with few inputs and many unstable ReLUs; default)",
    )
    parser.add_argument("--batch-size", type=int, default=VerifyConfig.batch_size, help="BaB domains per batch")
    parser.add_argument(
        "--refine",
        choices=[r.value for r in Refine],
        default=Refine.AUTO.value,
        help="tighten intermediate bounds by LP or MILP (HiGHS) before ReLU branch-and-bound (auto: MILP for MLPs "
        "with ≥ 3 ReLU layers)",
    )
    parser.add_argument(
        "--lp-workers", type=int, default=VerifyConfig.refine_workers, help="processes solving LP/MILP neurons"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--measure-memory",
        action="store_true",
        help="count live tensor memory (slower on CPU; always on with --report)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads per process (default: torch's choice; cores/devices with --devices)",
    )
    parallel = parser.add_argument_group(
        "parallel runs (Lightning predict loop; on CPU the other ranks re-run this command line)"
    )
    parallel.add_argument(
        "--strategy",
        choices=[s.value for s in Strategy],
        default=Strategy.SINGLE.value,
        help="single: each rank verifies its own instances; fsdp: weights sharded over a group of ranks (same "
        "bounds as single); tp: tensor parallel (default single)",
    )
    parallel.add_argument("--devices", type=int, default=1, help="ranks (processes) to run (default 1)")
    parallel.add_argument(
        "--group-size", type=int, help="fsdp/tp: ranks sharing one instance (default: all); the rest spread instances"
    )
    parallel.add_argument(
        "--tp-mode",
        choices=[m.value for m in TensorParallelMode],
        help="tp: rows (exact, split backward rows and BaB domains; default) or zones (Megatron zones, looser)",
    )
    parallel.add_argument("--zones", type=int, help="--tp-mode zones: at most this many zones from the input")
    parallel.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="cpu/gloo (default) or gpu/NCCL")
    return parser


def _check_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad combinations of the parallel options: an argparse error, before any process starts."""
    if args.devices < 1:
        parser.error(f"--devices must be ≥ 1, got {args.devices}")
    if args.tp_mode is not None and args.strategy != Strategy.TP.value:
        parser.error("--tp-mode applies to --strategy tp only")
    if args.zones is not None and args.tp_mode != TensorParallelMode.ZONES.value:
        parser.error("--zones needs --tp-mode zones")
    if args.zones is not None and args.zones < 1:
        parser.error(f"--zones must be ≥ 1, got {args.zones}")
    if args.strategy != Strategy.SINGLE.value and args.devices < 2:
        parser.error(f"--strategy {args.strategy} shards each instance over several ranks: give --devices ≥ 2")
    if args.group_size is not None:
        from lightning_fedshard.verify.lightning.module import predict_layout

        try:
            predict_layout(args.strategy, args.devices, args.group_size)
        except ValueError as error:
            parser.error(f"--group-size: {error}")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu: CUDA is not available")


def _parallel(args: argparse.Namespace) -> bool:
    return args.strategy != Strategy.SINGLE.value or args.devices > 1


def _single(args: argparse.Namespace, config: VerifyConfig) -> int:
    result = verify_files(args.onnx, args.vnnlib, config)
    line = f"{result.verdict.value}  ({result.decided_by or 'undecided'}, {sum(result.times.values()):.2f} s)"
    if result.counterexample_check:
        line += f"  counterexample check: {result.counterexample_check}"
    if result.reason:
        line += f"  [{result.reason}]"
    print(line)
    if args.result:
        write_result(args.result, result.verdict.value, result.counterexample)
    if args.report:
        args.report.write_text(json.dumps(result.to_report(), indent=2) + "\n")
    return 0


def _selected_instances(args: argparse.Namespace) -> list[Instance]:
    try:
        return select_instances(read_instances(args.instances), args.networks, args.limit, args.timeout)
    except ValueError as error:
        raise ValueError(f"{args.instances}: {error}") from None


def _expected(args: argparse.Namespace) -> tuple[Path, dict]:
    """The expected-verdicts file of a benchmark folder and its verdicts (none if there is no such file)."""
    path = args.expected or args.instances.parent / "expected_verdicts.csv"
    return path, read_expected(path) if path.is_file() else {}


def _print_row(row: InstanceResult) -> None:
    note = f"  [{row.error or row.reason}]" if row.error or row.reason else ("  WRONG" if row.wrong else "")
    print(f"{row.onnx} {row.vnnlib}: {row.verdict} in {row.time_s:.2f} s {row.decided_by}{note}", flush=True)


def _benchmark(args: argparse.Namespace, config: VerifyConfig) -> int:
    instances = _selected_instances(args)
    expected_path, expected = _expected(args)
    rows = []
    for row in run_instances(instances, config, expected):
        rows.append(row)
        _print_row(row)
        if args.results:
            write_results(args.results, rows)
    return _tables(rows, expected_path, args.by)


def _run_parallel(args: argparse.Namespace, config: VerifyConfig, instances: list[Instance]) -> list[dict] | None:
    """The Lightning predict loop over ``instances``: merged results on rank 0, ``None`` on the other ranks."""
    import logging

    from lightning_fedshard.verify.lightning.module import run_predict

    if args.threads is None and args.accelerator == "cpu" and args.devices > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)  # no banners
    return run_predict(
        instances,
        config,
        args.strategy,
        args.devices,
        args.tp_mode or TensorParallelMode.ROWS.value,
        args.zones,
        args.group_size,
        args.accelerator,
    )


def _entry_counterexample(entry: dict) -> Counterexample | None:
    if entry.get("counterexample") is None:
        return None
    return Counterexample(np.asarray(entry["counterexample"], dtype=np.float64), np.asarray(entry["counterexample_y"]))


def _single_parallel(args: argparse.Namespace, config: VerifyConfig) -> int:
    results = _run_parallel(args, config, [Instance(Path(args.onnx), Path(args.vnnlib), config.timeout)])
    if results is None:  # not rank 0: rank 0 reports
        return 0
    (entry,) = results
    if entry["verdict"] == "error":
        print(f"fedshard verify: error: {entry['error']}", file=sys.stderr)
        return 2
    total = sum(entry["times_s"].values())
    line = f"{entry['verdict']}  ({entry['decided_by'] or 'undecided'}, {total:.2f} s)"
    if entry["counterexample_check"]:
        line += f"  counterexample check: {entry['counterexample_check']}"
    print(line + f"  [{args.strategy}, {args.devices} devices]")
    if args.result:
        write_result(args.result, entry["verdict"], _entry_counterexample(entry))
    if args.report:
        report = {key: entry[key] for key in REPORT_FIELDS}
        report["total_time_s"] = total
        if entry["counterexample_check"]:
            report["counterexample_check"] = entry["counterexample_check"]
        if entry.get("reason"):
            report["reason"] = entry["reason"]
        report.update(strategy=args.strategy, devices=args.devices, per_rank=entry["per_rank"])
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _benchmark_parallel(args: argparse.Namespace, config: VerifyConfig) -> int:
    instances = _selected_instances(args)
    expected_path, expected = _expected(args)
    results = _run_parallel(args, config, instances)
    if results is None:  # not rank 0
        return 0
    rows = []
    for entry in results:
        onnx, vnnlib = Path(entry["onnx"]).name, Path(entry["vnnlib"]).name
        check = entry.get("counterexample_check") or ""
        row = InstanceResult(
            onnx,
            vnnlib,
            entry["verdict"],
            round(max((r["time_s"] for r in entry["per_rank"]), default=0.0), 3),
            decided_by=entry.get("decided_by") or "",
            counterexample_ok=("yes" if check == "ok" else f"no: {check}") if check else "",
            expected=expected.get((onnx, vnnlib), ""),
            error=entry.get("error") or "",
            reason=entry.get("reason") or "",
        )
        row.wrong, row.score = score_answer(row.verdict, row.expected, row.counterexample_ok)
        rows.append(row)
        _print_row(row)
    if args.results:
        write_results(args.results, rows)
    return _tables(rows, expected_path, args.by)


def _tables(rows: list, expected_path: Path, by: str = "network") -> int:
    """Print our table, and α,β-CROWN's next to ours on the instances it has a published result for."""
    print(summarise(rows, by))
    reference = reference_results(expected_path, rows) if expected_path.is_file() else []
    if reference:
        published = {(r.onnx, r.vnnlib) for r in reference}
        print(
            f"\non the {len(reference)} instances with a published α,β-CROWN result (its times include ~7 s start-up):"
        )
        print("ours\n" + summarise([r for r in rows if (r.onnx, r.vnnlib) in published], by))
        print("α,β-CROWN (VNN-COMP 2022)\n" + summarise(reference, by))
    return 1 if any(row.wrong for row in rows) else 0


#: Seconds a single-instance run keeps for what follows the search: the result file, a counterexample's replay,
#: the interpreter's exit (torch and onnxruntime teardown). Measured 0.5–1.5 s on a loaded 2-core machine.
EXIT_RESERVE_S = 1.0


def _process_age() -> float:
    """Seconds since this process started (interpreter start-up and imports included); 0 where unknown."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str] | None = None, startup_counts: bool | None = None) -> int:
    """Entry point of ``fedshard verify``; returns the exit status (2 for bad input). ``startup_counts`` (default:
    when ``argv`` is the process's own command line) makes a single instance's timeout count from the start of the
    process, interpreter and imports included, as VNN-COMP times it."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.summarise:
        rows = [row for path in args.summarise for row in read_results(path)]
        return _tables(rows, args.expected or Path(args.summarise[0]).parent / "expected_verdicts.csv", args.by)
    if args.instances is None and (args.onnx is None or args.vnnlib is None):
        parser.error("give ONNX and VNNLIB, or --instances CSV")
    if args.instances is not None and (args.onnx or args.vnnlib or args.result or args.report):
        parser.error("--instances runs a whole folder: do not also give ONNX/VNNLIB/--result/--report")
    _check_parallel(parser, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    timeout = args.timeout or 120.0
    if args.instances is None and (argv is None if startup_counts is None else startup_counts):
        # One instance: the timeout is a promise about the whole process, so start-up counts against it, and so
        # do writing the answer and the interpreter's exit after the search stops.
        timeout = max(timeout - _process_age() - EXIT_RESERVE_S, 1e-3)
    try:
        config = VerifyConfig(
            method=Method(args.method),
            bab=BabMode(args.bab),
            refine=Refine(args.refine),
            refine_workers=args.lp_workers,
            timeout=timeout,
            batch_size=args.batch_size,
            seed=args.seed,
            measure_memory=args.report is not None or args.measure_memory,  # the report holds memory peaks
        )
        if _parallel(args):
            return _benchmark_parallel(args, config) if args.instances is not None else _single_parallel(args, config)
        return _benchmark(args, config) if args.instances is not None else _single(args, config)
    except (OSError, ValueError) as error:
        print(f"fedshard verify: error: {error}", file=sys.stderr)
        return 2
