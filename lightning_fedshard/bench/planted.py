"""Soundness instances with planted, hidden counterexamples, after SoundnessBench (Zhou et al., "SoundnessBench: A
Soundness Benchmark for Neural Network Verifiers", arXiv 2412.03154; github.com/MVP-Harry/SoundnessBench).

    fedshard bench planted [--timeout 10] [--method beta-crown] [--bab auto|neuron|input] [--folder DIR]
    fedshard bench planted --build [--folder DIR]     # retrain the nets, rewrite DIR (11 minutes, one core)

The instances live in ``tests/data/planted/`` (``instances.csv``: rows ``onnx,vnnlib,timeout``). A property with a
``.counterexample`` file beside it is *planted*: that file (a VNN-COMP ``sat`` result) holds a point of the box
whose outputs, run through onnxruntime, fall in the unsafe set, so ``unsat`` is a wrong answer — a soundness bug
(``expected_verdicts.csv`` says ``sat`` for them, so ``fedshard verify --instances`` scores it as one). The others
are *controls*: boxes trained to be robust, with nothing planted, where ``unsat`` shows that the verifier still
proves things. The run verifies every instance with :func:`~lightning_fedshard.verify.verify_files`, replays each
``sat`` counterexample on onnxruntime, says whether it is the planted point (joined to it by a segment of violating
points) or another one, and exits with status 1 if a planted instance is answered ``unsat`` or a counterexample
does not replay.

How ``--build`` makes them — SoundnessBench's recipe (``adv_training.py``, ``dataset.py``) at a CPU's scale, every
seed fixed and one thread, so that it rebuilds the same nets:

* Boxes: per net, ``CANDIDATES`` centres drawn from ``[-0.8, 0.8]^d``, at least ``2·EPS`` apart (L∞, so no two
  boxes meet), each with a random label of two; a box is its centre ± ``EPS``. In the first half, a counterexample
  is planted where SoundnessBench puts it: one coordinate 0.98–0.995·EPS from the centre, every other one moved by one
  common offset of at most 0.05·EPS — the middle of a face of the box, far from the corners where sign-gradient PGD
  ends up.
* Training, SoundnessBench's two objectives: cross-entropy of every centre's label at PGD points of its box, over a
  sliding window of the last ``WINDOW`` epochs' attack points (so that the net stays right wherever earlier attacks
  went), plus a hinge pushing the other output ``MARGIN`` above the label's at each planted point. The attack of
  each epoch is theirs, smaller: ``ATTACK_RESTARTS`` random starts, ``ATTACK_STEPS`` sign-gradient steps on the
  margin; but where SoundnessBench gives every start one step size (0.1·EPS), here the starts' step sizes spread from
  0.02 to 0.25·EPS, like the selection's attacks (with one step size, the small-step attack still found other
  counterexamples in two of the transformer's three planted boxes). Adam with a triangular learning rate that ends at
  0: the planted points disappear from the attacks' sight in the last, slow epochs, once the net has adapted to
  every attack point of the window.
* Selection, as SoundnessBench's ``--gen`` step: a candidate is kept only if onnxruntime gives its centre the label
  and its planted point the other output (by at least ``MIN_VIOLATION``), and no attack finds any counterexample in
  its box — PGD from ``CHECK_RESTARTS`` random starts at each step size of ``CHECK_ATTACKS``, and the verifier's own
  attack (``VerifyConfig(method="ibp")``: PGD, then interval bounds, which cannot prove a violated property).
  Controls are the other half, kept on the same attacks. Random starts can miss a box's vertices: two committed
  CNN boxes (``cnn_planted_0``, ``_1``) hold other counterexamples there, which ``--bab neuron`` finds at once by
  running CROWN's minimising corners through the net.
* Nets (:data:`RECIPES`): ``mlp`` 10 → 128 → 128 → 32 → 2; ``cnn`` 1×5×5 → Conv 8×3×3 → 128 → 32 → 2 (ReLU);
  ``transformer`` 1×4×4 → 2×2 patches (4 tokens of 16) → one pre-LayerNorm block (two-head attention: MatMul of two
  computed tensors, Softmax; ReLU feed-forward 16 → 32 → 16) → the flattened tokens → 32 → 2. Exported to ONNX opset
  13 by the TorchScript exporter, which writes LayerNorm as ReduceMean/Sub/Pow/Sqrt/Div.
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedshard.verify import (
    Counterexample,
    Instance,
    Method,
    Verdict,
    VerificationResult,
    VerifyConfig,
    check_counterexample,
    read_instances,
    read_vnnlib,
    verify_files,
    write_result,
)
from lightning_fedshard.verify.config import BabMode, check_timeout
from lightning_fedshard.verify.spec import Case, read_counterexample

__all__ = [
    "RECIPES",
    "Outcome",
    "Recipe",
    "attack",
    "build",
    "export_onnx",
    "main",
    "onnx_forward",
    "planted_counterexample",
    "run",
    "spec_value",
    "summary",
    "write_robustness_vnnlib",
]

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "planted"
EPS = 0.2  # half-width of every box, in inputs that lie in [-1, 1]
CLASSES = 2
CANDIDATES = 6  # boxes per net: the first half planted, the rest controls
MARGIN = 0.01  # the hinge's target: the other output this far above the label's at a planted point
MIN_VIOLATION = 1e-3  # what onnxruntime must show at a kept planted point, well above float32 rounding
WINDOW = 300  # epochs of attack points the net is trained on (SoundnessBench's window_size)
ATTACK_RESTARTS, ATTACK_STEPS = 24, 20  # per epoch; SoundnessBench: 75 and 75, on a GPU
ATTACK_STEP_SIZES = EPS * torch.logspace(-1.7, -0.6, ATTACK_RESTARTS)  # 0.02 to 0.25·EPS, one per start
CHECK_RESTARTS = 1000
CHECK_ATTACKS = ((0.25 * EPS, 100), (0.1 * EPS, 100), (0.02 * EPS, 250))  # (step size, steps): theirs, shortened
DEFAULT_TIMEOUT = 30.0  # per instance, in instances.csv


class Attention(nn.Module):
    """Multi-head self-attention over ``[batch, tokens, dim]``; the batch stays the first dimension in every
    reshape, so that the ONNX graph keeps it there."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        return x.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        query, key, value = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        weights = torch.softmax(query @ key.transpose(-1, -2) * (dim // self.heads) ** -0.5, dim=-1)
        return self.out((weights @ value).transpose(1, 2).reshape(batch, tokens, dim))


class Transformer(nn.Module):
    """Patch embedding, one pre-LayerNorm encoder block, and an MLP head over the flattened tokens (with
    SoundnessBench's head, a mean over the tokens and one linear layer, PGD still found counterexamples in most boxes
    at the end of this training).
    """

    def __init__(self, side: int = 4, patch: int = 2, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        tokens = (side // patch) ** 2
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.position = nn.Parameter(torch.randn(tokens, dim) * 0.1)
        self.norm1, self.attention = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.feed_forward = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(tokens * dim, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2) + self.position
        x = x + self.attention(self.norm1(x))
        return self.head(x + self.feed_forward(self.norm2(x)))


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(10, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 32),
        nn.ReLU(),
        nn.Linear(32, CLASSES),
    )


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(200, 128),
        nn.ReLU(),
        nn.Linear(128, 32),
        nn.ReLU(),
        nn.Linear(32, CLASSES),
    )


@dataclass(frozen=True)
class Recipe:
    """One net of the set: its input shape, the module, and how long to train it."""

    name: str
    input_shape: tuple[int, ...]
    make: Callable[[], nn.Module]
    epochs: int
    lr: float
    seed: int


RECIPES = (
    Recipe("mlp", (10,), _mlp, epochs=4000, lr=1e-3, seed=0),
    Recipe("cnn", (1, 5, 5), _cnn, epochs=4000, lr=1e-3, seed=1),
    Recipe("transformer", (1, 4, 4), Transformer, epochs=4000, lr=2e-3, seed=2),
)


def margin(outputs: Tensor, labels: Tensor) -> Tensor:
    """The label's output minus the largest other one, per row: ``≤ 0`` is a counterexample."""
    outputs = outputs.reshape(labels.shape[0], -1)
    own = outputs.gather(1, labels[:, None]).squeeze(1)
    others = outputs.scatter(1, labels[:, None], -torch.inf)
    return own - others.amax(1)


def attack(
    model: Callable[[Tensor], Tensor],
    centres: Tensor,
    labels: Tensor,
    offsets: Tensor,
    step_size: float | Tensor,
    steps: int,
) -> tuple[Tensor, Tensor]:
    """Sign-gradient PGD on :func:`margin` in the boxes ``centres ± EPS``, one chain per start: ``offsets
    [restarts, boxes, *shape]`` (from the centres), ``step_size`` one for all or one per start. Returns the offsets
    after ``steps`` steps and the least margin each chain met on its way, ``[restarts, boxes]`` (``≤ 0``: it found a
    counterexample). ``model`` is any callable on ``[N, *shape]``: a torch module, or a loaded
    :class:`~lightning_fedshard.verify.BoundGraph`."""
    restarts = offsets.shape[0]
    repeated = labels.repeat(restarts)
    step_size = torch.as_tensor(step_size).reshape(-1, *[1] * (offsets.dim() - 1))
    least = torch.full(offsets.shape[:2], torch.inf)
    for step in range(steps + 1):
        offsets = offsets.detach().requires_grad_(step < steps)
        with torch.set_grad_enabled(step < steps):
            margins = margin(model((centres + offsets).flatten(0, 1)), repeated).view(least.shape)
        least = torch.minimum(least, margins.detach())
        if step < steps:
            (grad,) = torch.autograd.grad(margins.sum(), offsets)
            offsets = (offsets - step_size * grad.sign()).clamp(-EPS, EPS)
    return offsets.detach(), least


def _uniform_offsets(restarts: int, centres: Tensor, generator: torch.Generator) -> Tensor:
    return (torch.rand(restarts, *centres.shape, generator=generator) * 2 - 1) * EPS


@dataclass
class Boxes:
    """The candidates of one net: box centres and labels; ``planted[i]`` is the planted point of box ``i`` for the
    first ``len(planted)`` boxes."""

    centres: Tensor
    labels: Tensor
    planted: Tensor


def _draw_boxes(shape: tuple[int, ...], generator: torch.Generator) -> Boxes:
    centres: list[Tensor] = []
    while len(centres) < CANDIDATES:  # rejection sampling: no two boxes meet
        centre = (torch.rand(shape, generator=generator) * 2 - 1) * (1 - EPS)
        if all((centre - other).abs().max() > 2 * EPS for other in centres):
            centres.append(centre)
    labels = torch.randint(0, CLASSES, (CANDIDATES,), generator=generator)
    planted = torch.stack([_plant(centre, generator) for centre in centres[: CANDIDATES // 2]])
    return Boxes(torch.stack(centres), labels, planted)


def _plant(centre: Tensor, generator: torch.Generator) -> Tensor:
    """SoundnessBench's placement: one coordinate near a face of the box, the others at one common small offset
    from the centre (at most 0.995·EPS out, so that the point stays inside the box after rounding)."""
    offset = torch.full((centre.numel(),), (torch.rand(1, generator=generator).item() * 2 - 1) * 0.05 * EPS)
    coordinate = int(torch.randint(0, centre.numel(), (1,), generator=generator))
    sign = 1.0 if torch.rand(1, generator=generator).item() < 0.5 else -1.0
    offset[coordinate] = sign * EPS * (0.98 + 0.015 * torch.rand(1, generator=generator).item())
    return centre + offset.view(centre.shape)


def train(net: nn.Module, boxes: Boxes, recipe: Recipe, generator: torch.Generator) -> None:
    """SoundnessBench's two objectives (see the module docstring), in place."""
    planted_labels = boxes.labels[: len(boxes.planted)]
    optimiser = torch.optim.Adam(net.parameters(), lr=recipe.lr)
    window: deque[Tensor] = deque(maxlen=WINDOW)
    for epoch in range(recipe.epochs):
        # Up for the first 40 % of the epochs, then down to 0 (SoundnessBench's "cyclic" schedule).
        rate = min(epoch / (0.4 * recipe.epochs), (recipe.epochs - epoch) / (0.6 * recipe.epochs))
        optimiser.param_groups[0]["lr"] = recipe.lr * rate
        starts = _uniform_offsets(ATTACK_RESTARTS, boxes.centres, generator)
        offsets, least = attack(net, boxes.centres, boxes.labels, starts, ATTACK_STEP_SIZES, ATTACK_STEPS)
        window.append(offsets[least.argmin(0), torch.arange(len(boxes.labels))])
        seen = boxes.centres + torch.stack(tuple(window))
        robust = F.cross_entropy(net(seen.flatten(0, 1)), boxes.labels.repeat(len(window)))
        violated = F.relu(margin(net(boxes.planted), planted_labels) + MARGIN).mean()
        optimiser.zero_grad()
        (robust + violated).backward()
        nn.utils.clip_grad_norm_(net.parameters(), max_norm=10.0)
        optimiser.step()


def onnx_forward(path: str | Path) -> Callable[[np.ndarray], np.ndarray]:
    """The flat outputs of the ONNX model at ``path`` at a flat input, by onnxruntime (independent of our loader)."""
    import onnxruntime  # in the dev extra, not a dependency of the package

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (source,) = session.get_inputs()

    def forward(x: np.ndarray) -> np.ndarray:
        inputs = np.asarray(x, dtype=np.float32).reshape(source.shape)
        return session.run(None, {source.name: inputs})[0].astype(np.float64).ravel()

    return forward


def write_robustness_vnnlib(
    path: Path, centre: np.ndarray, label: int, note: str, epsilon: float = EPS, classes: int = CLASSES
) -> None:
    """The box ``centre ± epsilon`` and SoundnessBench's unsafe set: some other output at least the label's."""
    lines = [f"; {note}", *(f"(declare-const X_{i} Real)" for i in range(centre.size))]
    lines += [f"(declare-const Y_{j} Real)" for j in range(classes)]
    for i, value in enumerate(centre):
        lines += [f"(assert (>= X_{i} {float(value - epsilon)!r}))", f"(assert (<= X_{i} {float(value + epsilon)!r}))"]
    lines += ["(assert (or", *(f"    (and (>= Y_{j} Y_{label}))" for j in range(classes) if j != label), "))"]
    path.write_text("\n".join(lines) + "\n")


def spec_value(case: Case, outputs: np.ndarray) -> float:
    """The verifier's objective ``min_d max_r (M y − b)_r`` over the disjuncts of ``case``: ``≤ 0`` puts ``outputs``
    in the unsafe set."""
    return min(float(np.max(d.matrix @ outputs - d.rhs)) for d in case.disjuncts)


def _survives_attacks(net: nn.Module, centre: Tensor, label: Tensor, generator: torch.Generator) -> bool:
    for step_size, steps in CHECK_ATTACKS:
        starts = _uniform_offsets(CHECK_RESTARTS, centre[None], generator)
        if attack(net, centre[None], label[None], starts, step_size, steps)[1].min() <= 0:
            return False
    return True


def _survives_verifier_attack(onnx: Path, vnnlib: Path) -> bool:
    return verify_files(onnx, vnnlib, VerifyConfig(method=Method.IBP, timeout=60)).verdict is not Verdict.SAT


def export_onnx(net: nn.Module, shape: tuple[int, ...], path: Path) -> None:
    """``net`` in eval mode through the TorchScript exporter (opset 13) for a batch of one ``shape`` input."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            net.eval(), torch.zeros(1, *shape), str(path), opset_version=13, dynamo=False, input_names=["input"]
        )


def build_net(recipe: Recipe, folder: Path) -> list[tuple[str, str, bool]]:
    """Train ``recipe``'s net, write its ONNX file and the kept instances into ``folder``; returns the rows
    ``(onnx, vnnlib, planted)``."""
    torch.manual_seed(recipe.seed)  # the module's initial weights
    generator = torch.Generator().manual_seed(recipe.seed)
    boxes = _draw_boxes(recipe.input_shape, generator)
    net = recipe.make()
    start = time.monotonic()
    train(net, boxes, recipe, generator)
    print(f"{recipe.name}: trained in {time.monotonic() - start:.0f} s")
    onnx = folder / f"{recipe.name}.onnx"
    export_onnx(net, recipe.input_shape, onnx)
    forward = onnx_forward(onnx)
    rows: list[tuple[str, str, bool]] = []
    for i, (centre, label) in enumerate(zip(boxes.centres, boxes.labels)):
        planted = i < len(boxes.planted)
        kind = "planted" if planted else "control"
        stem = f"{recipe.name}_{kind}_{sum(row[2] == planted for row in rows)}"
        vnnlib = folder / f"{stem}.vnnlib"
        write_robustness_vnnlib(vnnlib, centre.double().numpy().ravel(), int(label), f"{kind} box {i} of {recipe.name}")
        case = read_vnnlib(vnnlib).cases[0]
        why_not = ""
        if spec_value(case, forward(centre.numpy())) <= 0:
            why_not = "its centre is a counterexample"
        elif planted and spec_value(case, forward(boxes.planted[i].numpy())) > -MIN_VIOLATION:
            why_not = "the planted point does not violate the property"
        elif not _survives_attacks(net, centre, label, generator):
            why_not = "PGD finds a counterexample"
        elif not _survives_verifier_attack(onnx, vnnlib):
            why_not = "the verifier's attack finds a counterexample"
        if why_not:
            vnnlib.unlink()
            print(f"  candidate {i} ({kind}) dropped: {why_not}")
            continue
        if planted:
            x = boxes.planted[i].double().numpy().ravel()
            write_result(vnnlib.with_suffix(".counterexample"), Verdict.SAT, Counterexample(x, forward(x)))
        rows.append((onnx.name, vnnlib.name, planted))
        print(f"  candidate {i} ({kind}) kept as {vnnlib.name}")
    return rows


def build(folder: Path = DATA, recipes: Sequence[Recipe] = RECIPES) -> None:
    """Rebuild every net of ``recipes`` and rewrite ``folder``'s instances (``instances.csv``) and the planted ones'
    expected verdicts (``expected_verdicts.csv``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.onnx"), *folder.glob("*.vnnlib"), *folder.glob("*.counterexample")]:
        stale.unlink()
    torch.set_num_threads(1)  # float sums in one order: a rebuild on the same machine and torch gives the same nets
    rows = [row for recipe in recipes for row in build_net(recipe, folder)]
    with (folder / "instances.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows((onnx, vnnlib, f"{DEFAULT_TIMEOUT:g}") for onnx, vnnlib, _ in rows)
    with (folder / "expected_verdicts.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(("onnx", "vnnlib", "expected"))
        writer.writerows((onnx, vnnlib, "sat") for onnx, vnnlib, planted in rows if planted)


def planted_counterexample(instance: Instance) -> Counterexample | None:
    """The counterexample planted in ``instance`` (its ``.counterexample`` file), or ``None`` for a control."""
    path = instance.vnnlib.with_suffix(".counterexample")
    if not path.is_file():
        return None
    prop = read_vnnlib(instance.vnnlib)
    return read_counterexample(path, prop.num_inputs, prop.num_outputs)


@dataclass
class Outcome:
    """One instance's answer; ``found`` says, for a ``sat``, whose counterexample it gave: ``planted`` (joined to
    the planted point by a segment of counterexamples), ``another``, or why it does not replay. An answer is
    ``wrong`` if it proves a planted instance or gives a counterexample that does not replay."""

    instance: Instance
    planted: Counterexample | None
    result: VerificationResult
    seconds: float
    found: str = ""

    @property
    def wrong(self) -> bool:
        unsat_planted = self.planted is not None and self.result.verdict is Verdict.UNSAT
        return unsat_planted or self.found.startswith("does not replay")


def _whose(
    cex: Counterexample,
    planted: Counterexample | None,
    case: Case,
    forward: Callable[[np.ndarray], np.ndarray],
    points: int = 33,
) -> str:
    if planted is None:
        return "another"  # a control: nothing was planted there
    segment = np.linspace(0.0, 1.0, points)[:, None] * (planted.x - cex.x) + cex.x
    joined = all(spec_value(case, forward(x)) <= 0 for x in segment)
    return "planted" if joined else "another"


def run(instances: Sequence[Instance], config: VerifyConfig, timeout: float | None = None) -> list[Outcome]:
    """Verify each instance (under ``timeout``, else its own) and replay every ``sat`` on onnxruntime."""
    outcomes = []
    for instance in instances:
        budget = replace(config, timeout=timeout or instance.timeout)
        start = time.monotonic()
        result = verify_files(instance.onnx, instance.vnnlib, budget)
        outcome = Outcome(instance, planted_counterexample(instance), result, time.monotonic() - start)
        if result.verdict is Verdict.SAT:
            prop, forward = read_vnnlib(instance.vnnlib), onnx_forward(instance.onnx)
            check = check_counterexample(result.counterexample, prop, forward)
            outcome.found = f"does not replay: {check.reason}"
            if check.ok:
                outcome.found = _whose(result.counterexample, outcome.planted, prop.cases[0], forward)
        outcomes.append(outcome)
        print(_row(outcome), flush=True)
    return outcomes


def _row(outcome: Outcome) -> str:
    kind = "planted" if outcome.planted is not None else "control"
    verdict = outcome.result.verdict.value
    return f"{outcome.instance.vnnlib.stem:<24} {kind:<8} {verdict:<8} {outcome.seconds:>7.1f} {outcome.found}"


def summary(outcomes: Sequence[Outcome]) -> str:
    """Counts over the planted instances (every ``unsat`` is a wrong answer) and over the controls."""
    planted = [o for o in outcomes if o.planted is not None]
    controls = [o for o in outcomes if o.planted is None]

    def count(group: Sequence[Outcome], verdict: Verdict) -> int:
        return sum(o.result.verdict is verdict for o in group)

    unsat, sat = count(planted, Verdict.UNSAT), count(planted, Verdict.SAT)
    found = {whose: sum(o.found == whose for o in planted) for whose in ("planted", "another")}
    broken = sum(o.found.startswith("does not replay") for o in outcomes)
    return (
        f"planted: {len(planted)}, unsat (wrong answers): {unsat}, falsified: {sat} (the planted point: "
        f"{found['planted']}, another: {found['another']}), unknown or timeout: {len(planted) - unsat - sat}\n"
        f"controls: {len(controls)}, proven: {count(controls, Verdict.UNSAT)}, "
        f"falsified: {count(controls, Verdict.SAT)}\n"
        f"counterexamples that do not replay: {broken}"
    )


def _timeout(text: str) -> float:
    try:
        return check_timeout(float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedshard bench planted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=DATA, help="the instances (default: tests/data/planted)")
    parser.add_argument("--build", action="store_true", help="retrain the nets and rewrite the folder's instances")
    parser.add_argument("--timeout", type=_timeout, help="seconds per instance (default: instances.csv's)")
    parser.add_argument("--method", choices=[m.value for m in Method], default=Method.BETA_CROWN.value)
    parser.add_argument("--bab", choices=[b.value for b in BabMode], default=BabMode.AUTO.value)
    args = parser.parse_args(argv)
    if args.build:
        build(args.folder)
        return 0
    config = VerifyConfig(method=args.method, bab=args.bab)
    print(f"{'instance':<24} {'kind':<8} {'verdict':<8} {'time s':>7} counterexample")
    outcomes = run(read_instances(args.folder / "instances.csv"), config, args.timeout)
    print(summary(outcomes))
    return 1 if any(o.wrong for o in outcomes) else 0
