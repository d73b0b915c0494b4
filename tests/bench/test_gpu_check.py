"""The GPU check's CPU-testable parts: ``make gpu-check`` without CUDA (runs nothing, says so, exit 0, a summary that
says skipped), the runner (a check that passes, fails, crashes or hangs is recorded and the next one still runs; the
budget cuts the last ones; a hung check's processes are killed), the summaries, and ``pytest -m cuda`` collecting the
GPU tests and skipping them here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_fedshard.bench.gpu_check import (
    CHECKS,
    DEFAULT_BUDGET_S,
    Check,
    check_timeout_s,
    cuda_test_files,
    dynamiq_step,
    junit_outcome,
    main,
    run_checks,
    verify_cuda_vs_cpu,
    vnncomp_root,
    write_summary,
)
from tests.launching import REPO, run_isolated

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
CASES = "tests.bench.gpu_check_cases"


@no_cuda
def test_make_gpu_check_without_cuda_runs_nothing_and_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path)}
    result = subprocess.run(
        ["make", "-s", "gpu-check", f"PYTHON={sys.executable}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "skipped, CUDA is not available" in result.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["skipped"] and summary["ok"] and summary["checks"] == []
    assert "**Skipped**: nothing was run." in (tmp_path / "gpu_check.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]  # no log: nothing ran


def test_an_interpreter_without_torch_skips_and_exits_0(tmp_path):
    # the machine's own python3 may have no torch at all (this CPU machine's has none): that is no CUDA either
    result = run_isolated(  # -S: no site-packages, so no torch
        [sys.executable, "-S", "lightning_fedshard/bench/gpu_check.py", "--out", str(tmp_path)], timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "skipped, torch is not installed" in result.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["skipped"] and summary["ok"] and summary["checks"] == []


def test_the_runner_survives_every_way_a_check_can_end(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    checks = [
        Check("ok", f"{CASES}:passes", 60, "passes"),
        Check("raises", f"{CASES}:raises", 60, "raises"),
        Check("crashes", f"{CASES}:crashes", 60, "crashes"),
        Check("hangs", f"{CASES}:hangs", 3, "hangs", {"pid_file": str(pid_file)}),
        Check("after", f"{CASES}:passes", 60, "runs after the hang", {"figure": "still here"}),
    ]
    results = run_checks(checks, budget_s=120, log=tmp_path / "log", reserve_s=1, min_check_s=1)
    assert [r.status for r in results] == ["pass", "fail", "error", "timeout", "pass"]
    assert results[0].figure == "42 GB/s" and results[0].details == [{"n": 1, "GB/s": 42.0}]
    assert "illegal memory access" in results[1].reason and "exit status 3" in results[2].reason
    assert results[3].seconds < 10 and results[4].figure == "still here"
    assert not _running(int(pid_file.read_text()))  # the hung check's own child was killed with it
    assert "RuntimeError: CUDA error" in (tmp_path / "log").read_text()  # the traceback is kept

    status = write_summary(tmp_path, results, {"date": "today", "machine": "1 × test GPU"})
    assert status == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["status"] for c in summary["checks"]] == ["pass", "fail", "error", "timeout", "pass"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "**FAILED**" in markdown and "| ok | pass | 42 GB/s |" in markdown and "| n | GB/s |" in markdown


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a killed one may linger as a zombie until its new parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_checks_the_budget_leaves_no_time_for_are_not_started(tmp_path):
    checks = [Check("late", f"{CASES}:passes", 60, "never started")]
    (result,) = run_checks(checks, budget_s=1.5, log=tmp_path / "log", reserve_s=1, min_check_s=1)
    assert result.status == "skipped" and "budget" in result.reason


def test_check_timeouts_shrink_to_the_budget():
    check = Check("x", "m:f", 90.0, "")
    assert check_timeout_s(check, remaining_s=400.0) == 90.0
    assert check_timeout_s(check, remaining_s=50.0) == 45.0
    assert check_timeout_s(check, remaining_s=24.0) is None  # under 20 s after the reserve: not started
    assert sum(c.timeout_s for c in CHECKS) <= DEFAULT_BUDGET_S < 8 * 60  # every check gets its whole timeout


@no_cuda
def test_main_without_cuda_writes_the_skipped_summary(tmp_path):
    assert main(["--out", str(tmp_path)], cuda_available=lambda: False) == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"]


@no_cuda
def test_pytest_m_cuda_collects_the_gpu_tests_and_skips_them_here():
    files = cuda_test_files()
    assert {f.parent.name for f in files} >= {"dynamiq", "models", "strategies", "verify"}
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", *map(str, files)]
    result = run_isolated(command, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " skipped" in summary and "passed" not in summary and "error" not in summary, summary
    assert int(summary.split()[0]) >= 10
    assert "cuda: CUDA is not available on this machine" in result.stdout


def test_the_pytest_figure_counts_failures_and_skips_from_pytests_junit_xml(tmp_path):
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
    )
    junit = tmp_path / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", str(tmp_path)]
    result = run_isolated(command, timeout=120)
    outcome = junit_outcome(junit, result.returncode)
    assert outcome["figure"] == "1 passed, 1 failed, 1 skipped" and outcome["status"] == "fail", outcome
    ((failing),) = outcome["details"]
    assert failing["test"].endswith("::test_fails") and "one is not two" in failing["message"]


def test_the_dynamiq_step_check_times_every_ddp_bucket_of_the_preset_on_the_cpu() -> None:
    from lightning_fedshard.models.config import LlamaConfig

    record = dynamiq_step(preset="llama3.1-tiny", steps=1, device="cpu")
    assert record["status"] == "pass", record
    assert [row["path"] for row in record["details"]] == ["dynamiq", "bf16 ring", "bf16 cast"]
    assert all(row["timed_steps"] == 1 and row["ms_per_step"] > 0 for row in record["details"])
    # every coordinate of the model's gradient, in DDP's buckets (a first one of 1 MiB, then up to 25 MiB)
    assert record["run"]["coordinates"] == LlamaConfig.from_name("llama3.1-tiny").num_parameters
    assert record["run"]["buckets"] == 2 and "one rank of 8" in record["figure"]
    assert "dynamiq-step" in {check.name for check in CHECKS}


def test_the_llama_checks_compare_eager_compiled_and_float8_runs_of_the_1b_alike_and_train_the_8b():
    llama = {c.name: c.kwargs for c in CHECKS if c.name.startswith("llama")}
    assert list(llama) == ["llama", "llama-compile", "llama-float8", "llama-8b"]
    shape = lambda kwargs: {k: v for k, v in kwargs.items() if k not in ("compile", "float8")}  # noqa: E731
    assert shape(llama["llama"]) == shape(llama["llama-compile"]) == shape(llama["llama-float8"])
    assert llama["llama-8b"]["preset"] == "llama3.1-8b" and llama["llama-8b"]["optimizer"] == "adamw8bit"


def test_the_8b_check_fits_an_h100_by_the_estimate_and_fp32_parameters_would_not():
    from lightning_fedshard.bench.gpu_check import LLAMA_8B, llama_memory_estimate
    from lightning_fedshard.models import LlamaConfig

    config, shape = LlamaConfig.from_name("llama3.1-8b"), (LLAMA_8B["batch"], 2048, True)
    estimate = llama_memory_estimate(config, "bf16-true", "adamw8bit", *shape)
    # 8.03e9 parameters: 2 bytes each for the weights and the gradients, 2 + 1/16 for AdamW8bit's codes and scales
    assert estimate["parameters"] == estimate["gradients"] == round(2 * config.num_parameters / 2**30, 2)
    assert 50 < estimate["total"] < 70 < 78  # an H100's usable memory
    assert llama_memory_estimate(config, "bf16-mixed", "adamw8bit", *shape)["total"] > 80


def test_the_8b_checks_code_path_runs_on_the_cpu_with_the_micro_preset(tmp_path):
    from lightning_fedshard.bench.gpu_check import LLAMA_8B

    small = {**LLAMA_8B, "preset": "llama3.1-micro", "batch": 2, "steps": 3, "warmup": 1}
    command = [sys.executable, "lightning_fedshard/bench/gpu_check.py", "--child"]  # its own process, as run there
    command += ["lightning_fedshard.bench.gpu_check:llama_throughput", "--result", str(tmp_path / "r.json")]
    command += ["--kwargs", json.dumps({**small, "seq_len": 32, "accelerator": "cpu"})]
    result = run_isolated(command, timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]
    record = json.loads((tmp_path / "r.json").read_text())
    (row,) = record["details"]
    assert record["status"] == "pass" and row["optimizer"] == "AdamW8bit", record
    assert row["compute dtype"] == "torch.bfloat16" and len(row["losses"]) == 3


@pytest.mark.skipif(vnncomp_root() is None, reason="the VNN-COMP files (../shared/vnncomp or ./.vnncomp) are absent")
def test_the_verify_check_compares_devices_and_where_auto_puts_each_instance():
    """On the CPU, ``auto`` against ``cpu``: two counterexamples found by the attack and a conv net of verivital
    (proven by interval bounds after a short attack), each instance once per device."""
    instances = (
        ("mnist_fc_2022", "onnx/mnist-net_256x6.onnx", "vnnlib/prop_6_0.03.vnnlib", 10.0),
        ("acasxu_2022", "onnx/ACASXU_run2a_1_2_batch_2000.onnx.gz", "vnnlib/prop_2.vnnlib", 10.0),
        ("verivital_2021", "onnx/Convnet_avgpool.onnx.gz", "vnnlib/avgpool_specs/prop_2_0.02.vnnlib", 3.0),
    )
    outcome = verify_cuda_vs_cpu(budget_s=60.0, devices=("auto", "cpu"), instances=instances)
    assert outcome["status"] == "pass" and outcome["figure"].startswith("3/3 same verdict, 0 sat/unsat"), outcome
    mnist, acasxu, conv = outcome["details"]
    assert [r["cpu verdict"] for r in (mnist, acasxu, conv)] == ["sat", "sat", "unsat"]
    assert mnist["cpu by"] == "pgd" and conv["cpu by"] == "ibp" and "attack" in conv["cpu phases"]
    # where a GPU is there, auto keeps the MLPs on the CPU and sends the conv net to it; here, all on the CPU
    assert mnist["pass GFLOP"] < 1 <= conv["pass GFLOP"] and {r["auto"] for r in (mnist, acasxu, conv)} == {"cpu"}
    assert all(r["auto pick s"] == r["cpu s"] for r in (mnist, acasxu, conv))
