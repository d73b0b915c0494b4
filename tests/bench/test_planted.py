"""``fedshard bench planted``: the committed instances with planted counterexamples are valid (each planted point lies
in its box and violates its property on onnxruntime), the verifier never proves one of them (which would be a
soundness bug), and PGD from random starts misses most of them (they are hidden)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedshard.bench import planted
from lightning_fedshard.verify import (
    Verdict,
    VerificationResult,
    VerifyConfig,
    check_counterexample,
    load_onnx,
    read_instances,
    read_vnnlib,
)

INSTANCES = read_instances(planted.DATA / "instances.csv")
PLANTED = [instance for instance in INSTANCES if planted.planted_counterexample(instance) is not None]
TIMEOUT = 3.0  # seconds per instance: the attack, the root bounds and some branch-and-bound on these small nets


def test_every_net_has_planted_instances_and_the_set_has_controls():
    assert {instance.onnx.name for instance in PLANTED} == {f"{recipe.name}.onnx" for recipe in planted.RECIPES}
    assert len(PLANTED) < len(INSTANCES)
    assert sum(path.stat().st_size for path in planted.DATA.iterdir()) < 2**20


@pytest.mark.parametrize("instance", PLANTED, ids=lambda instance: instance.vnnlib.stem)
def test_the_planted_counterexample_lies_in_its_box_and_violates_the_property(instance):
    prop, cex = read_vnnlib(instance.vnnlib), planted.planted_counterexample(instance)
    box = prop.cases[0].box
    assert np.all(box.lower <= cex.x) and np.all(cex.x <= box.upper)  # exactly, not within the scorer's 1e-4
    forward = planted.onnx_forward(instance.onnx)
    assert check_counterexample(cex, prop, forward).ok
    assert planted.spec_value(prop.cases[0], forward(cex.x)) <= -planted.MIN_VIOLATION  # not a rounding accident
    assert planted.spec_value(prop.cases[0], forward((box.lower + box.upper) / 2)) > 0  # the centre is right


def test_the_verifier_never_proves_a_planted_instance():
    outcomes = planted.run(PLANTED, VerifyConfig(), timeout=TIMEOUT)
    assert [(o.instance.vnnlib.stem, o.result.verdict.value, o.found) for o in outcomes if o.wrong] == []


def test_pgd_from_random_starts_misses_most_planted_counterexamples():
    """SoundnessBench's training attack (steps of 0.1·EPS) on the loaded graph, 100 random starts per box: any
    counterexample it finds, planted or not, counts against the instance."""
    generator = torch.Generator().manual_seed(0)
    found = []
    for instance in PLANTED:
        graph, box = load_onnx(instance.onnx), read_vnnlib(instance.vnnlib).cases[0].box
        centre = (box.lower + box.upper) / 2
        label = torch.tensor([int(np.argmax(planted.onnx_forward(instance.onnx)(centre)))])
        centre = torch.tensor(centre, dtype=torch.float32).view(1, *graph.input.shape)
        starts = (torch.rand(100, *centre.shape, generator=generator) * 2 - 1) * planted.EPS
        _, least = planted.attack(graph, centre, label, starts, step_size=0.1 * planted.EPS, steps=100)
        if least.min() <= 0:
            found.append(instance.vnnlib.stem)
    assert len(found) <= len(PLANTED) // 2, found


def _one_of_each(folder):
    """An ``instances.csv`` in ``folder`` with the first planted instance and the first control."""
    control = next(instance for instance in INSTANCES if instance not in PLANTED)
    rows = [f"{i.onnx},{i.vnnlib},{TIMEOUT}" for i in (PLANTED[0], control)]
    (folder / "instances.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_the_command_prints_a_row_per_instance_and_the_summary(tmp_path, capsys):
    assert planted.main(["--folder", str(_one_of_each(tmp_path)), "--timeout", "2"]) == 0
    out = capsys.readouterr().out
    assert PLANTED[0].vnnlib.stem in out and "planted: 1, unsat (wrong answers): 0" in out and "controls: 1" in out


def test_an_unsat_on_a_planted_instance_is_a_wrong_answer_and_fails_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(planted, "verify_files", lambda *args: VerificationResult(Verdict.UNSAT))
    assert planted.main(["--folder", str(_one_of_each(tmp_path))]) == 1
    assert "planted: 1, unsat (wrong answers): 1" in capsys.readouterr().out
