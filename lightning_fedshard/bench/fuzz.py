"""Differential fuzzing of the verifier, judged by onnxruntime: random small ONNX models over every operator the
loader accepts, properties placed at an output extreme found by sampling the box, and every method on each.

    fedshard bench fuzz [--cases 300] [--seed 0] [--out runs/fuzz] [--methods ibp crown ...] [--timeout 2]
                        [--methods-per-property K] [--workers 2]
                        [--sharded] [--sharded-cases 6] [--sharded-relaunches 4]
    fedshard bench fuzz --replay runs/fuzz/failures/case00012-at-crown-wrong-unsat

Each case is a model of one to four layers (:mod:`~lightning_fedshard.bench.fuzz_graphs`; case ``i`` starts with
operator ``i mod 58``, so every operator comes up in any run of that many cases) over a random box. Points of the
box (the centre, the corners, uniform ones) are run through onnxruntime, and a short sign-gradient search through
``load_onnx``'s graph, re-judged by onnxruntime, refines the best of them: ``x*`` with the extreme ``v*`` of a
randomly chosen output or linear combination of outputs. Three VNN-LIB properties state the unsafe set as
VNN-COMP does: ``at`` (``y ≥ v*`` for a maximum), ``inside`` (``y ≥ v* − m``, a relative margin ``m`` of 10⁻⁷…10⁻⁴),
both violated by the known witness ``x*``, and ``beyond`` (``y ≥ v* + M``), probably safe; sometimes as one of
several disjuncts. Every method then verifies each property with ``verify_files``; the methods other than
``beta-crown`` (the verifier's defaults) run without PGD, so that their bounds, not the attack, answer the
properties a witness violates (``--methods-per-property K``: K of them in turn, for more cases in the same time).
``--sharded`` verifies the properties of a few cases once more with ``run_predict`` on two ranks for each of
``fsdp``, ``tp`` and ``fsdp+rows``, all in one launch (launched again after a job that kills the group).

A run FAILS when (onnxruntime is the judge):

* ``wrong-unsat``: ``unsat`` on a property the witness violates;
* ``bad-counterexample``: ``sat`` whose counterexample does not replay within 1e-4 (``check_counterexample``
  on onnxruntime), or an answer whose own replay check (``counterexample_check``) failed;
* ``internal-error``: an exception out of ``verify_files``, a reason starting ``internal error``, an ``error``
  verdict, a sharded group that died;
* ``overtime``: wall time past the timeout + 1 s;
* ``worker-crash``: the process drawing and verifying a case died (native code: onnxruntime, torch); the case's
  folder is kept as ``OUT/failures/case<i>-worker-crash/`` and the run goes on.

Every failure is saved as ``OUT/failures/case<i>-<property>-<method>-<kind>/`` (``model.onnx``,
``property.vnnlib``, ``case.json`` with the seed, config, witness and onnxruntime's outputs at it, the answer and
what failed); ``--replay`` runs one again. The table gives verdicts per method and the failures by kind and by
operator; ``OUT/summary.json`` the same. The exit status is 1 when anything failed, else 0. The models, boxes and
properties depend on ``--seed`` alone; the verdicts of runs near their timeout depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

from lightning_fedshard.bench.fuzz_graphs import OPERATORS, FuzzModel, box_samples, ort_session, random_model
from lightning_fedshard.bench.fuzz_sharded import DEVICES
from lightning_fedshard.verify import (
    BoundGraph,
    OnnxLoadError,
    Property,
    Verdict,
    VerificationResult,
    VerifyConfig,
    check_counterexample,
    load_onnx,
    read_vnnlib,
    verify_files,
)

__all__ = ["METHODS", "Failure", "Witness", "judge", "main", "witness_value"]

#: The first attack's PGD off, and branch-and-bound's: the bounds alone answer, also where a witness exists.
NO_ATTACK = {"attack_restarts": 0, "attack_steps": 0, "attack_every": 0}
#: Every method and mode, as ``VerifyConfig`` fields; ``refine-lp`` runs on ReLU networks only.
METHODS: dict[str, dict] = {
    "ibp": {"method": "ibp", **NO_ATTACK},
    "crown": {"method": "crown", **NO_ATTACK},
    "alpha-crown": {"method": "alpha-crown", **NO_ATTACK},
    "beta-crown": {},  # the verifier as it is run: PGD, then bounds, then branch-and-bound as `auto` picks
    "bab-input": {"bab": "input", **NO_ATTACK},
    "bab-neuron": {"bab": "neuron", **NO_ATTACK},
    "refine-lp": {"bab": "neuron", "refine": "lp", **NO_ATTACK},
}
SHARDED_STRATEGIES = ("fsdp", "tp", "fsdp+rows")
#: The sharded runs' config: the bounds answer (as above), with β-CROWN branch-and-bound as `auto` picks.
SHARDED_CONFIG = NO_ATTACK
#: Properties whose witness ``x*`` violates them: ``unsat`` there is wrong.
WITNESSED = ("at", "inside")
#: Wall time a run may take past its timeout.
OVERTIME_S = 1.0
#: Draws of a case's model before the case is given up (a draw is discarded when onnxruntime rejects it, or its
#: output is empty, or its sampled outputs are not finite).
DRAWS = 12
SAMPLES = 200
GRADIENT_STEPS = 25
LAUNCH_MARGIN_S = 90.0


# ------------------------------------------------------------------------------------------ judging one answer


@dataclass(frozen=True)
class Failure:
    """What was wrong with one run: ``wrong-unsat``, ``bad-counterexample``, ``internal-error``, ``overtime`` or
    ``worker-crash``.
    For ``wrong-unsat``, ``real`` says whether the witness violates the property also with the model computed in
    float64 (a bound is unsound in real arithmetic) or only in onnxruntime's float32/float16 rounding, which the
    bounds must cover as well (None: not known)."""

    kind: str
    detail: str
    real: bool | None = None


def witness_value(prop: Property, y: np.ndarray) -> float:
    """How far outputs ``y`` are from the property's unsafe set: ``min`` over disjuncts of ``max`` over their rows
    of ``M y − b`` (every case's; the witness lies in every box). ``≤ 0``: ``y`` violates the property."""
    return min(float(np.max(d.matrix @ y - d.rhs, initial=-np.inf)) for case in prop.cases for d in case.disjuncts)


def judge(
    result: VerificationResult | None,
    error: str,
    wall_s: float,
    timeout: float,
    prop: Property,
    forward: Callable[[np.ndarray], np.ndarray],
    witness_y: np.ndarray | None = None,
    witness_y64: np.ndarray | None = None,
) -> list[Failure]:
    """The failures of one run: its ``result`` (``None`` with ``error``, the exception's traceback, when
    ``verify_files`` raised) and wall time against ``prop``, onnxruntime's ``forward`` (flat x → flat y) to replay
    a counterexample on, ``witness_y``, onnxruntime's outputs at a point of the box (if one is known), and
    ``witness_y64``, the model's outputs there in float64 arithmetic (if known), which tell a wrong ``unsat``'s
    cause."""
    failures = []
    if result is None:
        return [Failure("internal-error", error.strip().splitlines()[-1] if error.strip() else "exception")]
    if result.reason.startswith("internal error") or result.verdict is Verdict.ERROR:
        failures.append(Failure("internal-error", result.reason or result.error))
    if wall_s > timeout + OVERTIME_S:
        failures.append(Failure("overtime", f"{wall_s:.2f} s for a timeout of {timeout:g} s"))
    inside = 0.0 - witness_value(prop, witness_y) if witness_y is not None else -1.0
    if result.verdict is Verdict.UNSAT and inside >= 0:
        detail = (
            f"unsat (decided by {result.decided_by}), but onnxruntime's outputs at a point of the box are in the "
            f"unsafe set by {inside:.3g} (outputs up to {float(np.abs(witness_y).max()):.3g})"
        )
        if witness_y64 is None:
            failures.append(Failure("wrong-unsat", detail))
        else:
            inside64 = 0.0 - witness_value(prop, witness_y64)
            real = inside64 >= 0
            why = "a bound is unsound" if real else "onnxruntime's rounding puts it there, which the bounds must cover"
            detail += f"; in float64 arithmetic {'in' if real else 'outside'} it by {abs(inside64):.3g}: {why}"
            failures.append(Failure("wrong-unsat", detail, real))
    if result.verdict is Verdict.SAT:
        if result.counterexample is None:
            failures.append(Failure("bad-counterexample", "sat without a counterexample"))
        else:
            check = check_counterexample(result.counterexample, prop, forward)  # the scorer's tolerance
            if not check.ok:
                failures.append(Failure("bad-counterexample", f"does not replay on onnxruntime: {check.reason}"))
    if result.counterexample_check not in ("", "ok"):
        failures.append(Failure("bad-counterexample", f"the verifier's replay: {result.counterexample_check}"))
    return failures


class OnnxForward:
    """onnxruntime's flat-input forward pass of a model, the input cast to the model's own element type."""

    def __init__(self, path: Path) -> None:
        self.session = ort_session(Path(path).read_bytes())
        (inp,) = self.session.get_inputs()
        self.name, self.shape = inp.name, [d if isinstance(d, int) else 1 for d in inp.shape]
        self.dtype = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}[
            inp.type
        ]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        feed = np.asarray(x).astype(self.dtype).reshape(self.shape)
        return self.session.run(None, {self.name: feed})[0].astype(np.float64).ravel()


def float64_outputs(path: Path, x: np.ndarray) -> np.ndarray | None:
    """The model at ``path`` evaluated at ``x`` in float64: every float tensor and Cast target widened but Casts
    to float16, a rounding of the model's own. Real arithmetic up to float64's rounding, where onnxruntime rounds
    every float32 or float16 op. onnxruntime runs it; onnx's reference evaluator where onnxruntime has no float64
    kernel (Conv, ConvTranspose, AveragePool, GlobalAveragePool, LeakyRelu, Resize). None if neither can."""
    model = onnx.load(path)
    graph = model.graph
    shape = [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    scales = {n.input[i] for n in graph.node if n.op_type in ("Resize", "Upsample") for i in (1, 2) if i < len(n.input)}
    for value in (*graph.input, *graph.output):
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16) and tensor.name not in scales:
            wide = numpy_helper.to_array(tensor).astype(np.float64)
            graph.initializer[index].CopyFrom(numpy_helper.from_array(wide, tensor.name))
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.DOUBLE
    feed = {graph.input[0].name: np.asarray(x, np.float64).reshape(shape)}
    # onnx 1.23's reference BatchNormalization is wrong (78 off on a 4-channel example that onnxruntime gets right)
    engines = [lambda: ort_session(model).run(None, feed)[0]]
    if not any(node.op_type == "BatchNormalization" for node in graph.node):
        engines.append(lambda: ReferenceEvaluator(model).run(None, feed)[0])
    for engine in engines:
        try:
            return np.asarray(engine(), dtype=np.float64).ravel()
        except Exception:  # noqa: BLE001, S112 (no float64 kernel, or an evaluator's error: the next one, else unknown)
            continue
    return None


# ------------------------------------------------------------------------------------- a case and its witness


@dataclass
class Witness:
    """A point of the box with onnxruntime's outputs at it, extreme in ``objective`` (output → coefficient), and
    the outputs there in float64 arithmetic (:func:`float64_outputs`)."""

    x: np.ndarray
    y: np.ndarray
    objective: dict[int, float]
    maximise: bool
    value: float
    spread: float
    y64: np.ndarray | None = None


@dataclass
class PropertyFile:
    kind: str  # at, inside, beyond
    path: Path
    witnessed: bool
    disjuncts: int


@dataclass
class Run:
    """One verification of one property: by a method in process, or a sharded strategy."""

    method: str
    prop: str
    verdict: str
    wall_s: float
    failures: list[Failure] = field(default_factory=list)
    saved: str = ""


@dataclass
class Case:
    index: int
    seed: int
    draws: int
    discarded: list[str]
    folder: Path
    model: FuzzModel | None = None
    witness: Witness | None = None
    refused: str = ""
    properties: list[PropertyFile] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)


@dataclass
class _Sample:
    """What a case's model was drawn with: its generator (which then draws the properties), onnxruntime on the
    model, and the box samples with onnxruntime's outputs at them."""

    rng: np.random.Generator
    forward: OnnxForward
    points: np.ndarray
    outputs: np.ndarray


def _draw(seed: int, index: int, folder: Path) -> tuple[Case, _Sample | None]:
    """Case ``index``'s model: the first of its draws that onnxruntime runs with finite outputs at every sample
    (none if no draw was kept)."""
    first = list(OPERATORS)[index % len(OPERATORS)]
    discarded = []
    for draw in range(DRAWS):
        rng = np.random.default_rng([seed, index, draw])
        try:
            model = random_model(rng, first)
            onnx.save(model.model, folder / "model.onnx")
            forward = OnnxForward(folder / "model.onnx")
            points = box_samples(rng, model.lower, model.upper, model.input_type, SAMPLES, corners=256)
            with np.errstate(all="ignore"):
                outputs = np.stack([forward(x) for x in points])
        except Exception as error:  # noqa: BLE001 (onnx's checker and shape inference, onnxruntime: many types)
            discarded.append(f"rejected: {type(error).__name__}")
            continue
        if outputs.shape[1] == 0:  # an empty Slice or Split part: no output to state a property on
            discarded.append("no outputs")
            continue
        if not np.all(np.isfinite(outputs)):
            discarded.append("not finite")
            continue
        return Case(index, seed, draw + 1, discarded, folder, model), _Sample(rng, forward, points, outputs)
    return Case(index, seed, DRAWS, discarded, folder), None


def _objective(rng: np.random.Generator, outputs: int) -> dict[int, float]:
    """One output, or a combination of two or three with coefficients ±1, ±0.5, 2 or random."""
    if outputs == 1 or rng.random() < 0.5:
        return {int(rng.integers(0, outputs)): 1.0}
    chosen = rng.choice(outputs, size=min(outputs, int(rng.integers(2, 4))), replace=False)
    pool = [1.0, -1.0, 0.5, -0.5, 2.0, float(np.float32(rng.normal()))]
    return {int(i): float(rng.choice(pool)) for i in chosen}


def _find_witness(case: Case, sample: _Sample, graph: BoundGraph | None) -> Witness:
    """The sample, or a point of a gradient search through ``graph`` (``load_onnx``'s, where it loads) from the
    best four, where onnxruntime's objective is most extreme; the objective and its direction are drawn."""
    points, outputs = sample.points, sample.outputs
    objective = _objective(sample.rng, outputs.shape[1])
    coefficients = np.zeros(outputs.shape[1])
    coefficients[list(objective)] = list(objective.values())
    maximise = bool(sample.rng.random() < 0.5)
    sign = 1.0 if maximise else -1.0
    values = outputs @ coefficients
    spread = float(values.max() - values.min())
    if graph is not None:
        try:
            visited = _gradient_search(graph, case.model, points[np.argsort(-sign * values)[:4]], coefficients, sign)
        except Exception:  # noqa: BLE001 (a crash of the loaded graph is the runs' to report; the samples stand)
            visited = np.zeros((0, points.shape[1]))
        refined = np.stack([sample.forward(x) for x in visited]) if visited.size else np.zeros((0, outputs.shape[1]))
        finite = np.all(np.isfinite(refined), axis=1)
        points, outputs = np.concatenate([points, visited[finite]]), np.concatenate([outputs, refined[finite]])
        values = outputs @ coefficients
    best = int(np.argmax(sign * values))
    return Witness(points[best].astype(np.float64), outputs[best], objective, maximise, float(values[best]), spread)


def _gradient_search(
    graph: BoundGraph, model: FuzzModel, starts: np.ndarray, coefficients: np.ndarray, sign: float
) -> np.ndarray:
    """Sign-gradient steps up (``sign`` 1) or down the objective from ``starts``, kept in the box and rounded to
    the model's input type: every point visited (onnxruntime judges them)."""
    dtype = model.input_type
    lower, upper = torch.from_numpy(model.lower), torch.from_numpy(model.upper)
    x = torch.from_numpy(starts.astype(np.float64))
    step, weights = (upper - lower) / 4, torch.from_numpy(coefficients)
    visited = []
    for _ in range(GRADIENT_STEPS):
        x = x.detach().requires_grad_(True)
        y = graph(x.to(graph.dtype)).reshape(x.shape[0], -1).double()
        (grad,) = torch.autograd.grad((y @ weights).sum(), x)
        x = torch.minimum(torch.maximum(x + sign * step * grad.sign(), lower), upper).detach()
        visited.append(np.clip(x.numpy().astype(dtype), model.lower.astype(dtype), model.upper.astype(dtype)))
        step = step * 0.85
    return np.concatenate(visited)


def _loaded(case: Case) -> BoundGraph | None:
    """``load_onnx``'s graph of the case's model (float64 for a float64 model), or None where the loader refuses
    it: the reason is kept, and the verifier must then answer ``unknown``."""
    dtype = torch.float64 if case.model.input_type == np.float64 else torch.float32
    try:
        return load_onnx(case.folder / "model.onnx", dtype=dtype)
    except OnnxLoadError as error:
        case.refused = str(error)
        return None
    except Exception:  # noqa: BLE001 (a loader crash: the runs report it, as verify_files meets it too)
        return None


# ---------------------------------------------------------------------------------------------- the properties


@dataclass(frozen=True)
class Row:
    """One output constraint: ``Σ c_i·Y_i (<= | >=) rhs``, or ``Y_i (<= | >=) Y_other`` where ``other`` is set."""

    terms: tuple[tuple[int, float], ...]
    sense: str
    rhs: float = 0.0
    other: int | None = None

    def text(self) -> str:
        if self.other is not None:
            ((i, _),) = self.terms
            return f"({self.sense} Y_{i} Y_{self.other})"
        parts = [f"Y_{i}" if c == 1.0 else f"(* {float(c)!r} Y_{i})" for i, c in self.terms]
        left = parts[0] if len(parts) == 1 else f"(+ {' '.join(parts)})"
        return f"({self.sense} {left} {float(self.rhs)!r})"


def vnnlib_text(lower: np.ndarray, upper: np.ndarray, outputs: int, disjuncts: list[list[Row]], title: str) -> str:
    """A VNN-LIB 1.0 property: the box, and the unsafe set as one conjunction or an ``or`` of ``and``s."""
    lines = [f"; {title}"]
    lines += [f"(declare-const X_{i} Real)" for i in range(lower.size)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(outputs)]
    for i, (low, high) in enumerate(zip(lower, upper, strict=True)):
        lines += [f"(assert (>= X_{i} {float(low)!r}))", f"(assert (<= X_{i} {float(high)!r}))"]
    if len(disjuncts) == 1:
        lines += [f"(assert {row.text()})" for row in disjuncts[0]]
    else:
        ands = " ".join(f"(and {' '.join(row.text() for row in rows)})" for rows in disjuncts)
        lines.append(f"(assert (or {ands}))")
    return "\n".join(lines) + "\n"


def _side_rows(rng: np.random.Generator, witness: Witness, outputs: np.ndarray) -> tuple[list[Row], list[list[Row]]]:
    """Sometimes more to a property: rows the witness also satisfies, conjoined with the objective's, and decoy
    disjuncts beyond every sample's outputs (so that the property keeps the objective's verdict)."""
    count = outputs.shape[1]
    extra, decoys = [], []
    if rng.random() < 0.3:
        j = int(rng.integers(0, count))
        slack = abs(witness.y[j]) * 1e-3 + 1e-6
        up = bool(rng.random() < 0.5)
        extra.append(Row(((j, 1.0),), "<=" if up else ">=", witness.y[j] + slack if up else witness.y[j] - slack))
    if count > 1 and rng.random() < 0.3:
        j, k = (int(v) for v in rng.choice(count, size=2, replace=False))
        extra.append(Row(((j, 1.0),), "<=" if witness.y[j] <= witness.y[k] else ">=", other=k))
    for _ in range(int(rng.choice([0, 0, 1, 2]))):
        j = int(rng.integers(0, count))
        low, high = outputs[:, j].min(), outputs[:, j].max()
        gap = (high - low) + abs(high) * 1e-3 + 1.0
        decoys.append([Row(((j, 1.0),), ">=", high + gap) if rng.random() < 0.5 else Row(((j, 1.0),), "<=", low - gap)])
    return extra, decoys


def _write_properties(case: Case, rng: np.random.Generator, outputs: np.ndarray) -> list[PropertyFile]:
    """``at``, ``inside`` and ``beyond`` the witness's extreme, as described in the module docstring."""
    w, model = case.witness, case.model
    sense = ">=" if w.maximise else "<="
    toward = -1.0 if w.maximise else 1.0  # from the extreme into the box's outputs
    scale = max(abs(w.value), w.spread) or 1e-12
    thresholds = {
        "at": w.value,
        "inside": w.value + toward * 10 ** rng.uniform(-7, -4) * scale,
        "beyond": w.value - toward * 10 ** rng.uniform(-1.5, 0) * (w.spread + 1e-3 * abs(w.value) + 1e-9),
    }
    extra, decoys = _side_rows(rng, w, outputs)
    order = int(rng.integers(0, len(decoys) + 1))
    terms = tuple(sorted(w.objective.items()))
    files = []
    for kind, threshold in thresholds.items():
        path = case.folder / f"{kind}.vnnlib"
        for _ in range(4):  # float64 sums in the parser's order may put the witness an ulp outside: step outwards
            disjuncts = [*decoys[:order], [Row(terms, sense, threshold), *extra], *decoys[order:]]
            title = f"fuzz seed {case.seed} case {case.index}: {kind} the {'maximum' if w.maximise else 'minimum'}"
            path.write_text(vnnlib_text(model.lower, model.upper, outputs.shape[1], disjuncts, title))
            violated = witness_value(read_vnnlib(path), w.y) <= 0
            if violated or kind == "beyond":
                break
            threshold = float(np.nextafter(threshold, -np.inf if w.maximise else np.inf))
        files.append(PropertyFile(kind, path, kind in WITNESSED and violated, len(disjuncts)))
    return files


# ------------------------------------------------------------------------------------------------ running it


@dataclass(frozen=True)
class CaseJob:
    seed: int
    index: int
    work: Path
    out: Path
    methods: tuple[str, ...]
    timeout: float
    #: Methods per property (0: all), taken in turn over the run's properties.
    per_property: int = 0

    def methods_for(self, case: Case, position: int) -> list[str]:
        """The methods that verify property ``position`` of ``case``: all, or ``per_property`` of them in a rotation
        that shifts by one each case, so that every method sees every kind of property; LP refinement on ReLU
        networks only."""
        eligible = [m for m in self.methods if m != "refine-lp" or case.model.relu_only]
        if not self.per_property or self.per_property >= len(eligible):
            return eligible
        start = self.index + position * self.per_property
        return [eligible[(start + j) % len(eligible)] for j in range(self.per_property)]


def _verify(onnx_path: Path, vnnlib_path: Path, config: dict) -> tuple[VerificationResult | None, str, float]:
    start = time.monotonic()
    try:
        result, error = verify_files(onnx_path, vnnlib_path, VerifyConfig(**config)), ""
    except Exception:  # noqa: BLE001 (an exception out of verify_files is itself a finding)
        result, error = None, traceback.format_exc()
    return result, error, time.monotonic() - start


def fuzz_case(job: CaseJob) -> Case:
    """Draw case ``job.index``, find its witness, write its properties and verify each with every method."""
    folder = job.work / f"case{job.index:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(job.seed * 1_000_003 + job.index)
    case, sample = _draw(job.seed, job.index, folder)
    if sample is None:
        return case
    case.witness = _find_witness(case, sample, _loaded(case))
    case.witness.y64 = float64_outputs(folder / "model.onnx", case.witness.x)
    case.properties = _write_properties(case, sample.rng, sample.outputs)
    forward = sample.forward
    for position, prop in enumerate(case.properties):
        parsed = read_vnnlib(prop.path)
        for method in job.methods_for(case, position):
            config = {**METHODS[method], "timeout": job.timeout, "seed": job.index}
            result, error, wall = _verify(folder / "model.onnx", prop.path, config)
            witness = (case.witness.y, case.witness.y64) if prop.witnessed else (None, None)
            failures = judge(result, error, wall, job.timeout, parsed, forward, *witness)
            run = Run(method, prop.kind, result.verdict.value if result else "exception", wall, failures)
            if failures:
                run.saved = str(save_failure(job.out, case, prop, run, config, result, error))
            case.runs.append(run)
    return case


def save_failure(
    out: Path, case: Case, prop: PropertyFile, run: Run, config: dict, result: VerificationResult | None, error: str
) -> Path:
    """A folder that reproduces one failed run: the model, the property and ``case.json`` (the case, the witness,
    the run's ``config``, its ``result`` and ``error``, a traceback or a dead group's stderr)."""
    folder = out / "failures" / f"case{case.index:05d}-{prop.kind}-{run.method}-{run.failures[0].kind}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(case.folder / "model.onnx", folder / "model.onnx")
    shutil.copyfile(prop.path, folder / "property.vnnlib")
    w, cex = case.witness, result.counterexample if result is not None else None
    record = {
        "reproduce": f"python -m lightning_fedshard.bench.fuzz --replay {folder}",
        "failures": [asdict(f) for f in run.failures],
        "seed": case.seed,
        "case": case.index,
        "draw": case.draws - 1,
        "operators": case.model.operators,
        "variants": case.model.variants,
        "input_type": np.dtype(case.model.input_type).name,
        "box_style": case.model.box_style,
        "property": prop.kind,
        "disjuncts": prop.disjuncts,
        "witnessed": prop.witnessed,
        "objective": {f"Y_{i}": c for i, c in w.objective.items()},
        "maximise": w.maximise,
        "witness": {
            "x": w.x.tolist(),
            "onnxruntime_y": w.y.tolist(),
            "float64_y": w.y64.tolist() if w.y64 is not None else None,
            "objective": w.value,
        },
        "method": run.method,
        "config": config,
        "verdict": run.verdict,
        "decided_by": result.decided_by if result else None,
        "reason": result.reason if result else "",
        "error": result.error if result else "",
        "counterexample_check": result.counterexample_check if result else "",
        "counterexample": {"x": cex.x.tolist(), "y": cex.y.tolist()} if cex is not None else None,
        "wall_s": run.wall_s,
        "traceback": error,
    }
    (folder / "case.json").write_text(json.dumps(record, indent=1))
    return folder


def _quiet_worker() -> None:
    """A worker's settings: one torch thread (the workers share the cores), and no log or warning per run (an
    internal error the verifier logs is a finding of its own)."""
    torch.set_num_threads(1)
    logging.getLogger("lightning_fedshard.verify").setLevel(logging.CRITICAL)
    warnings.simplefilter("ignore")


@contextmanager
def _quietly() -> Iterator[None]:
    """A worker's settings for runs in this process, restored afterwards."""
    threads, logger = torch.get_num_threads(), logging.getLogger("lightning_fedshard.verify")
    level = logger.level
    with warnings.catch_warnings():
        _quiet_worker()
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            logger.setLevel(level)


def _pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet_worker)


def _cases(jobs: list[CaseJob], workers: int, work: Callable[[CaseJob], Case] = fuzz_case) -> Iterator[Case]:
    """The cases of ``jobs`` in order, ``work`` done by ``workers`` processes. A worker that dies (a segfault in
    onnxruntime on a drawn model: seed 2005 lost a whole chunk to one) breaks the pool and every job in flight:
    the first of them runs again alone, to tell a crash from a bystander, and the rest in a new pool."""
    if workers == 1:
        with _quietly():
            yield from map(work, jobs)
        return
    pending = list(jobs)
    while pending:
        with _pool(workers) as pool:
            futures = [pool.submit(work, job) for job in pending]
            broken = None
            for position, future in enumerate(futures):
                try:
                    yield future.result()
                except BrokenProcessPool:
                    broken = position
                    break
        if broken is None:
            return
        yield _alone(pending[broken], work)
        pending = pending[broken + 1 :]


def _alone(job: CaseJob, work: Callable[[CaseJob], Case]) -> Case:
    """``job`` in a pool of its own; if its worker dies there too, a case with one ``worker-crash`` failure, its
    folder (the model as far as it was written) kept under ``failures/``."""
    with _pool(1) as pool:
        try:
            return pool.submit(work, job).result()
        except BrokenProcessPool:
            pass
    folder = job.out / "failures" / f"case{job.index:05d}-worker-crash"
    drawn = job.work / f"case{job.index:05d}"
    if drawn.is_dir():
        shutil.copytree(drawn, folder, dirs_exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    detail = f"the worker process died on seed {job.seed}, case {job.index} (a crash in native code)"
    run = Run("worker", "-", "crashed", 0.0, [Failure("worker-crash", detail)], saved=str(folder))
    (folder / "case.json").write_text(json.dumps({"seed": job.seed, "case": job.index, "failures": [detail]}))
    return Case(job.index, job.seed, 0, [], drawn, runs=[run])


# ------------------------------------------------------------------------------------------- sharded strategies


def run_sharded(
    cases: list[Case], strategies: tuple[str, ...], timeout: float, work: Path, out: Path, relaunches: int
) -> tuple[list[tuple[Case, Run]], int]:
    """Every property of ``cases`` with every strategy, in one launch of two ranks. A job that kills the group is
    an ``internal-error``; the group is then launched again (at most ``relaunches`` times: each costs the ranks'
    start, ~15 s) for the jobs left, less the crashed strategy's other jobs on the same model (they would likely
    crash again). The runs, and how many jobs were skipped."""
    jobs = [(case, prop, strategy) for case in cases for prop in case.properties for strategy in strategies]
    runs: list[tuple[Case, Run]] = []
    crashed: set[tuple[int, str]] = set()  # (case, strategy)
    pending = list(range(len(jobs)))
    for launch in range(relaunches + 1):
        folder = work / f"sharded{launch}"
        folder.mkdir(parents=True)
        rows = [[jobs[j][2], str(jobs[j][0].folder / "model.onnx"), str(jobs[j][1].path), timeout] for j in pending]
        (folder / "spec.json").write_text(json.dumps({"jobs": rows, "config": SHARDED_CONFIG, "out": str(folder)}))
        stderr = _launch(folder / "spec.json", len(rows), len(rows) * (timeout + OVERTIME_S + 1) + LAUNCH_MARGIN_S)
        finished = 0
        while finished < len(pending) and (folder / f"{finished}.pickle").is_file():
            result = pickle.loads((folder / f"{finished}.pickle").read_bytes())
            runs.append(_judge_sharded(jobs[pending[finished]], result, timeout, out))
            finished += 1
        if finished == len(pending):
            return runs, 0
        case, prop, strategy = jobs[pending[finished]]
        failure = Failure("internal-error", f"the sharded group died: {_first_error(stderr)[:300]}")
        config = dict(SHARDED_CONFIG, strategy=strategy, timeout=timeout)
        run = Run(strategy, prop.kind, "died", 0.0, [failure])
        run.saved = str(save_failure(out, case, prop, run, config, None, stderr[-20000:]))
        runs.append((case, run))
        crashed.add((case.index, strategy))
        pending = [j for j in pending[finished + 1 :] if (jobs[j][0].index, jobs[j][2]) not in crashed]
        if not pending:
            return runs, 0
    return runs, len(pending)


def _launch(spec: Path, results: int, limit_s: float) -> str:
    """Run the sharded worker's two ranks (``torch.distributed.run``: both start at once, and a rank that dies
    takes the other down) in a session of their own, until they exit, ``results`` result files are written (the
    group's teardown is not waited for) or ``limit_s`` passes (a hung group, killed whole); their stderr."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={DEVICES}"]
    command += ["-m", "lightning_fedshard.bench.fuzz_sharded", str(spec)]
    log = spec.with_name("stderr.txt")
    with log.open("w") as stderr:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)
        deadline = time.monotonic() + limit_s
        while proc.poll() is None:
            done = sum(1 for _ in spec.parent.glob("*.pickle")) >= results
            if done or time.monotonic() > deadline:
                for pid in (*_descendants(proc.pid), proc.pid):  # the launcher starts each rank in a session of its own
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                proc.wait()
                if not done:
                    stderr.write(f"\nRuntimeError: the group was killed after {limit_s:.0f} s\n")
            time.sleep(0.1)
    return log.read_text(errors="replace")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's ``/proc/PID/task/*/children``), children first."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for child in map(int, children.read_text().split()):
                found += [child, *_descendants(child)]
    return found


def _first_error(stderr: str) -> str:
    """The error a dead group died of: the first a rank raised (the others' are the broken connections after)."""
    lines = stderr.splitlines()
    raised = [line for line in lines if re.match(r"\[rank\d+\]: [A-Za-z_][\w.]*: ", line)]  # "[rank1]: mod.Error: …"
    fallback = [line for line in lines if "Error" in line] or ["the group exited without an error message"]
    return (raised or fallback[-1:])[0].strip()


def _judge_sharded(
    job: tuple[Case, PropertyFile, str], result: VerificationResult, timeout: float, out: Path
) -> tuple[Case, Run]:
    case, prop, strategy = job
    forward = OnnxForward(case.folder / "model.onnx")
    witness = (case.witness.y, case.witness.y64) if prop.witnessed else (None, None)
    failures = judge(result, "", result.time_s, timeout, read_vnnlib(prop.path), forward, *witness)
    run = Run(strategy, prop.kind, result.verdict.value, result.time_s, failures)
    if failures:
        config = dict(SHARDED_CONFIG, strategy=strategy, timeout=timeout)
        run.saved = str(save_failure(out, case, prop, run, config, result, ""))
    return case, run


# ------------------------------------------------------------------------------------------------- reporting


#: What a wrong ``unsat``'s witness does in float64 arithmetic (:attr:`Failure.real`), and the table's breakdowns.
_CAUSES = {True: "unsound in float64 too", False: "onnxruntime's rounding", None: "unknown"}
_BREAKDOWN = ("methods", "properties", "float64", "operators")


def summarise(
    cases: list[Case], sharded: list[tuple[Case, Run]], elapsed_s: float, methods: list[str], sharded_skipped: int = 0
) -> dict:
    """Counts for the table and ``summary.json``: verdicts per method, failures by kind and by operator."""
    runs = [(case, run) for case in cases for run in case.runs] + sharded
    drawn = [case for case in cases if case.model is not None]
    names = [m for m in (*methods, *SHARDED_STRATEGIES) if any(run.method == m for _, run in runs)]
    per_method = {
        m: dict(Counter(run.verdict for _, run in runs if run.method == m))
        | {
            "runs": sum(run.method == m for _, run in runs),
            "failed": sum(bool(run.failures) for _, run in runs if run.method == m),
        }
        for m in names
    }
    by_kind: dict[str, dict] = {}
    by_operator: dict[str, dict] = {
        name: {"cases": 0, "refused": 0, "failing_cases": 0, "kinds": Counter()} for name in OPERATORS
    }
    for case in drawn:
        for name in set(case.model.operators):
            by_operator[name]["cases"] += 1
            by_operator[name]["refused"] += bool(case.refused)
    failing: dict[int, set[str]] = defaultdict(set)
    for case, run in runs:
        for failure in run.failures:
            entry = by_kind.setdefault(
                failure.kind,
                {"runs": 0, "methods": Counter(), "properties": Counter(), "operators": Counter(), "layers": 5},
            )
            entry["runs"] += 1
            entry["methods"][run.method] += 1
            entry["properties"][run.prop] += 1
            operators = case.model.operators if case.model is not None else []  # a crashed worker's: unknown
            entry["operators"].update(set(operators))
            if failure.kind == "wrong-unsat":
                entry.setdefault("float64", Counter())[_CAUSES[failure.real]] += 1
            if len(operators) < entry["layers"]:  # the example: a model with the fewest layers
                entry["layers"], entry["example"] = len(operators), run.saved
            failing[case.index].add(failure.kind)
    for case in drawn:
        for name in set(case.model.operators):
            by_operator[name]["failing_cases"] += bool(failing[case.index])
            by_operator[name]["kinds"].update(failing[case.index])
    discarded = Counter(reason for case in cases for reason in case.discarded)
    return {
        "cases": len(drawn),
        "not_drawn": len(cases) - len(drawn),
        "discarded_draws": dict(discarded),
        "runs": len(runs),
        "elapsed_s": elapsed_s,
        "cases_per_s": len(drawn) / elapsed_s if elapsed_s > 0 else math.nan,
        "failed_runs": sum(bool(run.failures) for _, run in runs),
        "sharded_skipped": sharded_skipped,
        "failing_cases": len(failing),
        "methods": per_method,
        "failures_by_kind": by_kind,
        "operators": by_operator,
    }


def table(summary: dict, seed: int) -> str:
    """The printed report of :func:`summarise`'s counts."""
    lines = [
        f"fedshard bench fuzz (seed {seed}): {summary['cases']} cases, {summary['runs']:,} runs in "
        f"{summary['elapsed_s']:.1f} s ({summary['cases_per_s']:.2f} cases/s); draws discarded: "
        + (", ".join(f"{n} {why}" for why, n in sorted(summary["discarded_draws"].items())) or "none")
        + (f"; {summary['not_drawn']} cases without a model" if summary["not_drawn"] else ""),
        "",
        f"{'method':<12} {'runs':>6} {'sat':>6} {'unsat':>6} {'unknown':>8} {'timeout':>8} {'other':>6} {'failed':>7}",
    ]
    for method, counts in summary["methods"].items():
        other = counts["runs"] - sum(counts.get(v, 0) for v in ("sat", "unsat", "unknown", "timeout"))
        lines.append(
            f"{method:<12} {counts['runs']:>6} {counts.get('sat', 0):>6} {counts.get('unsat', 0):>6} "
            f"{counts.get('unknown', 0):>8} {counts.get('timeout', 0):>8} {other:>6} {counts['failed']:>7}"
        )
    if summary["sharded_skipped"]:
        lines.append(f"sharded runs skipped after the group died (--sharded-relaunches): {summary['sharded_skipped']}")
    lines += ["", f"failures: {summary['failed_runs']} runs in {summary['failing_cases']} cases"]
    for kind, entry in sorted(summary["failures_by_kind"].items()):
        parts = [part for part in _BREAKDOWN if part in entry]
        counts = {part: ", ".join(f"{k} {n}" for k, n in entry[part].most_common(8)) for part in parts}
        lines.append(f"  {kind:<19} {entry['runs']:>5} runs")
        lines += [f"{'':<8}{part + ':':<12}{counts[part]}" for part in parts] + [f"{'':<8}e.g. {entry['example']}"]
    covered = {name: e for name, e in summary["operators"].items() if e["cases"]}
    lines += ["", f"operators: {len(covered)}/{len(OPERATORS)} drawn; failing cases / cases (refused by the loader):"]
    for name, entry in summary["operators"].items():
        if entry["failing_cases"] or entry["refused"]:
            kinds = ", ".join(f"{k} {n}" for k, n in entry["kinds"].most_common())
            refused = f" ({entry['refused']} refused)" if entry["refused"] else ""
            lines.append(f"  {name:<27} {entry['failing_cases']:>3}/{entry['cases']:<3}{refused:<15} {kinds}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- entry points


def replay(folder: Path) -> int:
    """Run a saved failure again, judged as the fuzzer judged it; 1 if it still fails."""
    record = json.loads((folder / "case.json").read_text())
    config = dict(record["config"])
    strategy = config.pop("strategy", None)
    onnx_path, vnnlib_path = folder / "model.onnx", folder / "property.vnnlib"
    if strategy is None:
        with _quietly():
            result, error, wall = _verify(onnx_path, vnnlib_path, config)
    else:
        with tempfile.TemporaryDirectory(prefix="fuzz-replay-") as work:
            spec = {
                "jobs": [[strategy, str(onnx_path), str(vnnlib_path), config["timeout"]]],
                "config": SHARDED_CONFIG,
                "out": work,
            }
            (Path(work) / "spec.json").write_text(json.dumps(spec))
            start = time.monotonic()
            stderr = _launch(Path(work) / "spec.json", 1, config["timeout"] + LAUNCH_MARGIN_S)
            answer = Path(work) / "0.pickle"
            result = pickle.loads(answer.read_bytes()) if answer.is_file() else None
            error = "" if result else f"the sharded group died: {_first_error(stderr)}"
            wall = result.time_s if result else time.monotonic() - start
    prop = read_vnnlib(vnnlib_path)
    witness, wide = record["witness"], record["witness"]["float64_y"]
    known = (
        (np.array(witness["onnxruntime_y"]), np.array(wide) if wide else None) if record["witnessed"] else (None, None)
    )
    failures = judge(result, error, wall, config["timeout"], prop, OnnxForward(onnx_path), *known)
    verdict = result.verdict.value if result else "died" if strategy else "exception"
    print(f"{folder}: {record['method']} answers {verdict} in {wall:.2f} s (was {record['verdict']})")
    for failure in failures:
        print(f"  {failure.kind}: {failure.detail}")
    print("  still fails" if failures else "  passes now")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedshard bench fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="models drawn (case i starts with operator i mod 58)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/fuzz"), help="failures/ and summary.json go here")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per run")
    parser.add_argument(
        "--methods-per-property",
        type=int,
        default=0,
        help="verify each property with this many of the methods, in "
        "turn (default: all of them); more cases in the same time",
    )
    parser.add_argument("--sharded", action="store_true", help="also fsdp, tp and fsdp+rows on two ranks")
    parser.add_argument("--sharded-cases", type=int, default=6, help="this many cases, spread over the run")
    parser.add_argument(
        "--sharded-relaunches", type=int, default=4, help="launches of the ranks after a crash (each ~15 s)"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes verifying cases")
    parser.add_argument("--replay", type=Path, help="run one saved failure folder again")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    counts = (args.sharded_cases, args.sharded_relaunches, args.methods_per_property)
    if args.cases < 1 or args.workers < 1 or min(counts) < 0:
        parser.error("--cases and --workers must be ≥ 1, --sharded-* and --methods-per-property ≥ 0")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error("--timeout must be a positive number of seconds")
    shutil.rmtree(args.out / "failures", ignore_errors=True)  # this run's failures only
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-") as work:
        jobs = [
            CaseJob(args.seed, i, Path(work), args.out, tuple(args.methods), args.timeout, args.methods_per_property)
            for i in range(args.cases)
        ]
        cases = []
        for case in _cases(jobs, min(args.workers, args.cases)):
            cases.append(case)
            if len(cases) % max(1, args.cases // 10) == 0:
                failed = sum(bool(run.failures) for c in cases for run in c.runs)
                print(f"  {len(cases)}/{args.cases} cases, {failed} failed runs", file=sys.stderr, flush=True)
        sharded, skipped = [], 0
        if args.sharded:
            loaded = [c for c in cases if c.model is not None and not c.refused]
            chosen = loaded[:: max(1, len(loaded) // max(1, args.sharded_cases))][: args.sharded_cases]  # spread out
            sharded, skipped = run_sharded(
                chosen, SHARDED_STRATEGIES, args.timeout, Path(work), args.out, args.sharded_relaunches
            )
    summary = summarise(cases, sharded, time.monotonic() - start, args.methods, skipped)
    print(table(summary, args.seed))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if summary["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
