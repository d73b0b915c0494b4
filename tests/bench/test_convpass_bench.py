"""``fedshard bench convpass`` on a tiny conv net: one row per step of each pass, FLOPs as torch counts them, a\nbaseline checkout timed in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_fedshard.bench import convpass
from lightning_fedshard.verify import load_onnx
from lightning_fedshard.verify.ops.conv import Conv2d
from tests.verify.onnx_models import export


def _tiny_root(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 5),
    )
    folder = tmp_path / "tiny" / "onnx"
    folder.mkdir(parents=True)
    export(model, (2, 6, 6), folder / "net.onnx")
    return tmp_path


def test_table_has_one_row_per_step_and_a_total(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tiny_root(tmp_path)
    convpass.main(["--root", str(root), "--networks", "tiny", "--rows", "16", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("net.onnx")]
    # passes from conv 1 (one step) and conv 2 (two steps: itself, then conv 1)
    assert len(lines) == 4 and lines[-1].split()[1] == "total"
    assert all(float(line.split()[-1]) > 0 for line in lines)


def test_baseline_checkout_is_timed_step_by_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # This checkout as its own baseline: the subprocess finds the same steps, and old/new is printed for each.
    root = _tiny_root(tmp_path)
    here = Path(convpass.__file__).resolve().parents[2]
    convpass.main(
        ["--root", str(root), "--networks", "tiny", "--rows", "16", "--repeats", "1", "--baseline", str(here)]
    )
    out = capsys.readouterr().out
    assert "old/new" in out.splitlines()[1]
    lines = [line for line in out.splitlines() if line.startswith("net.onnx")]
    assert len(lines) == 4 and all(len(line.split()) == len(lines[0].split()) for line in lines[:-1])


def test_flops_equal_torch_count_of_the_transposed_conv(tmp_path: Path) -> None:
    root = _tiny_root(tmp_path)
    path = root / "tiny" / "onnx" / "net.onnx"
    rows = convpass.measure_network(path, rows=16, repeats=1)
    graph = load_onnx(path)
    assert [(row["start"], row["layer"], row["window"]) for row in rows] == [
        (rows[0]["layer"], rows[0]["layer"], "1x1"),
        (rows[1]["layer"], rows[1]["layer"], "1x1"),
        (rows[1]["layer"], rows[0]["layer"], "3x3"),
    ]
    for row in rows:
        op = graph.by_name[row["layer"]].op
        assert isinstance(op, Conv2d)
        # The step is a transposed convolution of [rows, C_out, kH, kW] windows into [rows, C_in, ., .].
        kh, kw = map(int, row["window"].split("x"))
        with FlopCounterMode(display=False) as counter:
            F.conv_transpose2d(torch.ones(row["rows"], op.weight.shape[0], kh, kw), op.weight, groups=op.groups)
        assert row["flops"] == counter.get_total_flops()
        assert row["rows"] == 16


def test_missing_network_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        convpass.main(["--root", str(tmp_path), "--networks", "absent"])
