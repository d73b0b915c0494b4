"""``fedshard bench deadlines``: which instance of a set it runs, and the overrun it reports."""

from __future__ import annotations

import pytest

from lightning_fedshard.bench.deadlines import overrun, slowest_instance


def test_the_slowest_instance_is_the_largest_net_then_the_longest_timeout(tmp_path):
    (tmp_path / "onnx").mkdir()
    for name, size in (("small.onnx", 10), ("big.onnx", 1000)):
        (tmp_path / "onnx" / name).write_bytes(b"x" * size)
    (tmp_path / "instances.csv").write_text(
        "onnx/small.onnx,vnnlib/a.vnnlib,900\nonnx/big.onnx,vnnlib/b.vnnlib,30\nonnx/big.onnx,vnnlib/c.vnnlib,60\n"
    )
    assert slowest_instance(tmp_path) == (tmp_path / "onnx" / "big.onnx", tmp_path / "vnnlib" / "c.vnnlib")


def test_a_set_without_instances_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="instances.csv"):
        slowest_instance(tmp_path)
    (tmp_path / "instances.csv").write_text("")
    with pytest.raises(ValueError, match="no instances"):
        slowest_instance(tmp_path)


def test_the_overrun_is_the_largest_wall_minus_timeout():
    assert overrun({5.0: 4.5, 10.0: 11.25, 20.0: 19.0}) == pytest.approx(1.25)
    assert overrun({5.0: 4.0, 10.0: 9.5}) == pytest.approx(-0.5)
