"""``fedshard bench convpass`` on a tiny conv net: one row per convolution, FLOPs as torch counts them."""

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


def test_table_has_one_row_per_conv_and_a_total(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tiny_root(tmp_path)
    convpass.main(["--root", str(root), "--networks", "tiny", "--rows", "16", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("net.onnx")]
    assert len(lines) == 3 and lines[-1].split()[1] == "total"
    assert all(float(line.split()[-1]) > 0 for line in lines)


def test_flops_equal_torch_count_of_the_transposed_conv(tmp_path: Path) -> None:
    root = _tiny_root(tmp_path)
    path = root / "tiny" / "onnx" / "net.onnx"
    rows = convpass.measure_network(path, rows=16, repeats=1)
    convs = [node.op for node in load_onnx(path).nodes if isinstance(node.op, Conv2d)]
    assert len(rows) == len(convs) == 2
    for row, op in zip(rows, convs, strict=True):
        # The step on 1×1 windows is a transposed convolution of [rows, C_out, 1, 1] into [rows, C_in, kH, kW].
        with FlopCounterMode(display=False) as counter:
            F.conv_transpose2d(torch.ones(row["rows"], op.weight.shape[0], 1, 1), op.weight, groups=op.groups)
        assert row["flops"] == counter.get_total_flops()
        assert row["rows"] == 16


def test_missing_network_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        convpass.main(["--root", str(tmp_path), "--networks", "absent"])
