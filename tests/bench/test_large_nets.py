"""The large nets of ``fedshard bench budget``: each exports to ONNX with a property onnxruntime agrees with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from lightning_fedshard.bench.large_nets import LARGE_NETS, export_net
from lightning_fedshard.verify import read_vnnlib


@pytest.mark.parametrize("name", sorted(LARGE_NETS))
def test_the_property_protects_onnxruntimes_top_class_at_the_box_centre(name: str, tmp_path: Path):
    onnx_path, vnnlib_path = export_net(name, tmp_path)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (model_input,) = session.get_inputs()
    prop = read_vnnlib(vnnlib_path)
    (case,) = prop.cases
    centre = (case.box.lower + case.box.upper) / 2
    np.testing.assert_allclose(case.box.upper - case.box.lower, 2 * LARGE_NETS[name][1], rtol=1e-6)
    scores = session.run(None, {model_input.name: centre.astype(np.float32).reshape(model_input.shape)})[0].ravel()
    assert prop.num_outputs == scores.size
    # Every disjunct "y_j ≥ y_label" is violated at the centre: the label is the top class there.
    assert all(float(np.max(d.matrix @ scores - d.rhs)) > 0 for d in case.disjuncts)
