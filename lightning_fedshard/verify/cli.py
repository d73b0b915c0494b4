"""``fedshard verify``: one instance (ONNX + VNN-LIB) or a whole VNN-COMP ``instances.csv``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lightning_fedshard.verify.config import Method, VerifyConfig
from lightning_fedshard.verify.instances import (
    read_expected,
    read_instances,
    read_results,
    reference_results,
    run_instances,
    summarise,
    write_results,
)
from lightning_fedshard.verify.spec import write_result
from lightning_fedshard.verify.verifier import verify_files

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedshard verify",
        description="Verify ONNX networks against VNN-LIB properties (IBP, CROWN, α-CROWN, β-CROWN BaB).",
        epilog="examples:\n  fedshard verify net.onnx prop.vnnlib --timeout 120 --result out.txt --report r.json\n"
        "  fedshard verify --instances mnist_fc/instances.csv --results results.csv",
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
    parser.add_argument("--networks", nargs="+", help="with --instances: only the rows of these ONNX file names")
    parser.add_argument("--method", choices=[m.value for m in Method], default=Method.BETA_CROWN.value)
    parser.add_argument("--batch-size", type=int, default=VerifyConfig.batch_size, help="BaB domains per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    return parser


def _single(args: argparse.Namespace, config: VerifyConfig) -> int:
    result = verify_files(args.onnx, args.vnnlib, config)
    line = f"{result.verdict.value}  ({result.decided_by or 'undecided'}, {sum(result.times.values()):.2f} s)"
    if result.counterexample_check:
        line += f"  counterexample check: {result.counterexample_check}"
    print(line)
    if args.result:
        write_result(args.result, result.verdict.value, result.counterexample)
    if args.report:
        args.report.write_text(json.dumps(result.to_report(), indent=2) + "\n")
    return 0


def _benchmark(args: argparse.Namespace, config: VerifyConfig) -> int:
    instances = read_instances(args.instances)
    if args.networks:
        unknown = set(args.networks) - {i.onnx.name for i in instances}
        if unknown:
            raise ValueError(f"{args.instances} has no rows for {sorted(unknown)}")
        instances = [i for i in instances if i.onnx.name in args.networks]
    if args.limit is not None:
        instances = instances[: args.limit]
    if args.timeout is not None:
        instances = [type(i)(i.onnx, i.vnnlib, args.timeout) for i in instances]
    expected_path = args.expected or args.instances.parent / "expected_verdicts.csv"
    expected = read_expected(expected_path) if expected_path.is_file() else {}
    rows = []
    for row in run_instances(instances, config, expected):
        rows.append(row)
        note = f"  [{row.error}]" if row.error else ("  WRONG" if row.wrong else "")
        print(f"{row.onnx} {row.vnnlib}: {row.verdict} in {row.time_s:.2f} s {row.decided_by}{note}", flush=True)
        if args.results:
            write_results(args.results, rows)
    return _tables(rows, expected_path)


def _tables(rows: list, expected_path: Path) -> int:
    """Print our table, and α,β-CROWN's next to ours on the instances it has a published result for."""
    print(summarise(rows))
    reference = reference_results(expected_path, rows) if expected_path.is_file() else []
    if reference:
        published = {(r.onnx, r.vnnlib) for r in reference}
        print(
            f"\non the {len(reference)} instances with a published α,β-CROWN result (its times include ~7 s start-up):"
        )
        print("ours\n" + summarise([r for r in rows if (r.onnx, r.vnnlib) in published]))
        print("α,β-CROWN (VNN-COMP 2022)\n" + summarise(reference))
    return 1 if any(row.wrong for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fedshard verify``; returns the exit status (2 for bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.summarise:
        rows = [row for path in args.summarise for row in read_results(path)]
        return _tables(rows, args.expected or Path(args.summarise[0]).parent / "expected_verdicts.csv")
    if args.instances is None and (args.onnx is None or args.vnnlib is None):
        parser.error("give ONNX and VNNLIB, or --instances CSV")
    if args.instances is not None and (args.onnx or args.vnnlib or args.result or args.report):
        parser.error("--instances runs a whole folder: do not also give ONNX/VNNLIB/--result/--report")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        config = VerifyConfig(
            method=Method(args.method), timeout=args.timeout or 120.0, batch_size=args.batch_size, seed=args.seed
        )
        return _benchmark(args, config) if args.instances is not None else _single(args, config)
    except (OSError, ValueError) as error:
        print(f"fedshard verify: error: {error}", file=sys.stderr)
        return 2
