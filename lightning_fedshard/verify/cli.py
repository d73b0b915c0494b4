"""``fedshard verify``: one instance (ONNX + VNN-LIB) or a whole VNN-COMP ``instances.csv``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from lightning_fedshard.verify.config import BabMode, Method, Refine, Verdict, VerifyConfig, check_timeout
from lightning_fedshard.verify.device import DEVICE_CHOICES, check_device
from lightning_fedshard.verify.heap import keep_freed_memory
from lightning_fedshard.verify.instances import (
    Instance,
    read_expected,
    read_instances,
    read_results,
    reference_results,
    run_instance,
    run_instances,
    score_answer,
    select_instances,
    summarise,
    write_results,
)
from lightning_fedshard.verify.onnx import UnsupportedModelError
from lightning_fedshard.verify.result import VerificationResult
from lightning_fedshard.verify.shard.plan import Strategy, TensorParallelMode
from lightning_fedshard.verify.spec import UnsupportedPropertyError, write_result
from lightning_fedshard.verify.verifier import prepare_files

__all__ = ["UNSUPPORTED_STATUS", "main"]

#: ``--prepare``'s exit status for a well-formed instance the verifier does not take on.
UNSUPPORTED_STATUS = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedshard verify",
        description="Verify ONNX networks against VNN-LIB properties (IBP, CROWN, α-CROWN, β-CROWN BaB).",
        epilog="examples:\n  fedshard verify net.onnx prop.vnnlib --timeout 120 --result out.txt --report r.json\n"
        "  fedshard verify --instances mnist_fc/instances.csv --results results.csv\n"
        "  fedshard verify net.onnx prop.vnnlib --strategy fsdp --devices 2 --report r.json\n"
        "  fedshard verify --instances mnist_fc/instances.csv --strategy tp --devices 4 --group-size 2\n"
        "  fedshard verify net.onnx prop.vnnlib --strategy fsdp+rows --devices 4\n"
        "  fedshard verify net.onnx prop.vnnlib --prepare\n\n"
        "exit status: 0; 1 if an answer is wrong (it contradicts the expected verdict, or a sat has no counterexample "
        "that replays); 2 for bad input, or an instance that could not be verified (after every row is written); "
        f"with --prepare {UNSUPPORTED_STATUS} for an instance the verifier does not take on",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("onnx", nargs="?", help="ONNX model (.onnx or .onnx.gz)")
    parser.add_argument("vnnlib", nargs="?", help="VNN-LIB property (.vnnlib or .vnnlib.gz)")
    parser.add_argument(
        "--timeout",
        type=_seconds,
        help=f"seconds, positive and finite (default {VerifyConfig.timeout:g}; with --instances: each row's own)",
    )
    parser.add_argument("--result", type=Path, help="write the VNN-COMP result file here")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="load the instance and run one forward pass, verify nothing (VNN-COMP's prepare_instance.sh): exit 0 "
        f"if the verifier takes it on, {UNSUPPORTED_STATUS} if not (unsupported operator or property), 2 if the files "
        "cannot be read",
    )
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
        choices=[*(m.value for m in BabMode), "relu"],
        default=BabMode.AUTO.value,
        help="branch-and-bound splits neurons (neuron: ReLU phases and the inputs of other non-linear ops; 'relu' "
        "is the same), the input box (input), or chooses (auto: the input box of networks with few inputs and many "
        "neurons to split; default)",
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
        "--device",
        choices=DEVICE_CHOICES,
        help="where model, bounds and domains live: cpu, cuda (each rank its own GPU) or auto (cuda where available "
        "and the net is big enough for a GPU to win, see verify.device.AUTO_CUDA_FLOPS); default cpu, cuda with "
        "--accelerator gpu. LP/MILP refinement solves on the CPU either way",
    )
    parser.add_argument(
        "--memory",
        type=_gib,
        help="GiB of working memory per process (per rank): every pass sizes its chunks to fit, and a pass that "
        f"cannot answers unknown with the reason (default: {VerifyConfig.memory_fraction:g} of the memory free at "
        "the start, cgroup limits respected; on CUDA of the GPU's free memory)",
    )
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
        "bounds as single); tp: tensor parallel; fsdp+rows: fsdp's weight shards with tp rows' split passes and "
        "branch-and-bound domains (default single)",
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


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of GiB, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        return check_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}") from None


def _check_writable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every file the run will write can be written: an argparse error now, not after the verdict is computed."""
    for option, path in (("--result", args.result), ("--report", args.report), ("--results", args.results)):
        if path is None:
            continue
        if path.is_dir():
            parser.error(f"{option} {path}: is a directory")
        if not path.parent.is_dir():
            parser.error(f"{option} {path}: no such directory {path.parent}")
        if not os.access(path if path.exists() else path.parent, os.W_OK):
            parser.error(f"{option} {path}: permission denied")


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
    try:
        check_device(_device(args))
    except ValueError as error:
        parser.error(f"--device: {error}")


def _device(args: argparse.Namespace) -> str:
    """``--device``, or where none is given the accelerator's: ``cuda`` for ``--accelerator gpu``, else ``cpu``."""
    if args.device is not None:
        return args.device
    return "cuda" if args.accelerator == "gpu" else "cpu"


def _parallel(args: argparse.Namespace) -> bool:
    return args.strategy != Strategy.SINGLE.value or args.devices > 1


def _prepare(args: argparse.Namespace) -> int:
    """``--prepare``: load the instance and warm up (:func:`prepare_files`); an instance the verifier would answer
    ``unknown`` at load is :data:`UNSUPPORTED_STATUS`, so that VNN-COMP's runner skips it (scored ``unknown``)."""
    try:
        summary = prepare_files(args.onnx, args.vnnlib, _device(args))
    except (UnsupportedModelError, UnsupportedPropertyError) as error:
        print(f"fedshard verify: unsupported: {error}", file=sys.stderr)
        return UNSUPPORTED_STATUS
    print(f"prepared: {summary}")
    return 0


def _single(args: argparse.Namespace, config: VerifyConfig) -> int:
    instance = Instance(Path(args.onnx), Path(args.vnnlib), config.timeout)
    if not _parallel(args):
        return _answer(args, run_instance(instance, config))
    results = _run_parallel(args, config, [instance])
    if results is None:  # not rank 0: rank 0 answers
        return 0
    (result,) = results
    return _answer(args, result, f"  [{args.strategy}, {args.devices} devices]")


def _answer(args: argparse.Namespace, result: VerificationResult, note: str = "") -> int:
    """Print the answer for one instance and write its result file and report; 2 if it could not be verified."""
    if result.verdict is Verdict.ERROR:
        print(f"fedshard verify: error: {result.error}", file=sys.stderr)
        return 2
    line = f"{result.verdict.value}  ({result.decided_by or 'undecided'}, {sum(result.times.values()):.2f} s)"
    if result.counterexample_check:
        line += f"  counterexample check: {result.counterexample_check}"
    if result.reason:
        line += f"  [{result.reason}]"
    print(line + note)
    if args.result:
        write_result(args.result, result.verdict, result.counterexample)
    if args.report:
        report = result.to_report()
        if _parallel(args):
            report.update(strategy=args.strategy, devices=args.devices)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _selected_instances(args: argparse.Namespace) -> list[Instance]:
    try:
        return select_instances(read_instances(args.instances), args.networks, args.limit, args.timeout)
    except ValueError as error:
        raise ValueError(f"{args.instances}: {error}") from None


def _expected(args: argparse.Namespace) -> tuple[Path, dict[tuple[str, str], str]]:
    """The expected-verdicts file of a benchmark folder and its verdicts (none if there is no such file)."""
    path = args.expected or args.instances.parent / "expected_verdicts.csv"
    return path, read_expected(path) if path.is_file() else {}


def _names(result: VerificationResult) -> tuple[str, str]:
    return Path(result.onnx).name, Path(result.vnnlib).name


def _print_row(result: VerificationResult, expected: dict[tuple[str, str], str]) -> None:
    wrong, _ = score_answer(result, expected.get(_names(result), ""))
    problem = result.error or result.reason
    note = f"  [{problem}]" if problem else ("  WRONG" if wrong else "")
    onnx, vnnlib = _names(result)
    print(
        f"{onnx} {vnnlib}: {result.verdict.value} in {result.time_s:.2f} s {result.decided_by or ''}{note}", flush=True
    )


def _benchmark(args: argparse.Namespace, config: VerifyConfig) -> int:
    """Every instance of the CSV, one process (each row printed and written as it is decided) or the predict
    loop; then the tables."""
    instances = _selected_instances(args)
    expected_path, expected = _expected(args)
    if _parallel(args):
        results = _run_parallel(args, config, instances)
        if results is None:  # not rank 0
            return 0
    else:
        results = run_instances(instances, config)
    rows = []
    for result in results:
        rows.append(result)
        _print_row(result, expected)
        if args.results:
            write_results(args.results, rows, expected)
    return _tables(rows, expected, expected_path, args.by)


def _run_parallel(
    args: argparse.Namespace, config: VerifyConfig, instances: list[Instance]
) -> list[VerificationResult] | None:
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


def _tables(
    results: list[VerificationResult], expected: dict[tuple[str, str], str], expected_path: Path, by: str = "network"
) -> int:
    """Print our table, and α,β-CROWN's next to ours on the instances it has a published result for; the exit
    status: 1 if an answer is wrong, else 2 if an instance could not be verified, else 0."""
    print(summarise(results, expected, by))
    reference = reference_results(expected_path, results) if expected_path.is_file() else []
    if reference:
        published = {_names(r) for r in reference}
        print(
            f"\non the {len(reference)} instances with a published α,β-CROWN result (its times include ~7 s start-up):"
        )
        print("ours\n" + summarise([r for r in results if _names(r) in published], expected, by))
        print("α,β-CROWN (VNN-COMP 2022)\n" + summarise(reference, read_expected(expected_path), by))
    if any(score_answer(r, expected.get(_names(r), ""))[0] for r in results):
        return 1
    return 2 if any(r.verdict is Verdict.ERROR for r in results) else 0


#: Seconds a single-instance run keeps for what follows the search: the result file, a counterexample's replay and
#: the process's exit (which skips the interpreter's teardown, see :func:`main`).
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
        results = [result for path in args.summarise for result in read_results(path)]
        scored = {key: verdict for path in args.summarise for key, verdict in read_expected(path).items() if verdict}
        published = args.expected or Path(args.summarise[0]).parent / "expected_verdicts.csv"
        return _tables(results, scored, published, args.by)
    if args.instances is None and (args.onnx is None or args.vnnlib is None):
        parser.error("give ONNX and VNNLIB, or --instances CSV")
    if args.instances is not None and (args.onnx or args.vnnlib or args.result or args.report or args.prepare):
        parser.error("--instances runs a whole folder: do not also give ONNX/VNNLIB/--result/--report/--prepare")
    if args.prepare and (args.result or args.report or _parallel(args)):
        parser.error("--prepare verifies nothing: do not also give --result/--report/--strategy/--devices")
    _check_parallel(parser, args)
    _check_writable(parser, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # the bound passes' temporaries reuse pages instead of faulting in new ones
    timeout = VerifyConfig.timeout if args.timeout is None else args.timeout
    whole_process = args.instances is None and (argv is None if startup_counts is None else startup_counts)
    if whole_process:
        # One instance: the timeout is a promise about the whole process, so start-up counts against it, and so
        # does writing the answer after the search stops.
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
            device=_device(args),
            memory=args.memory,
            measure_memory=args.report is not None or args.measure_memory,  # the report holds memory peaks
        )
        if args.instances is not None:
            return _benchmark(args, config)
        status = _prepare(args) if args.prepare else _single(args, config)
    except (OSError, ValueError) as error:
        print(f"fedshard verify: error: {error}", file=sys.stderr)
        return 2
    if whole_process and not _parallel(args):
        # The answer is written. The interpreter's own teardown (torch's and onnxruntime's finalisers) takes ~2 s
        # on a 2-core machine and would break the timeout; a one-instance process holds nothing else to release.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
