"""Count specifications: a small segmentation UNet whose ONNX ends in the counting head of VNN-COMP 2022's carvana
benchmark, and properties on the count, verified end to end.

    python -m lightning_fedshard.bench counting [--timeout 60] [--out runs/counting]   # also writes instances.csv

(``fedshard bench counting ...`` is the same.) The net takes 3 image channels and a mask channel (4×16×16):
conv down, conv, transposed conv up, a skip connection from the image, 2-class logits, then ``ArgMax → OneHot →
Transpose → Cast → Gather(class 1) → Equal(mask) → Cast → ReduceSum``: the number of pixels whose predicted class
is the mask's. Random weights (seeded); the mask of every property is the net's own prediction at the box centre,
so the count there is all 256 pixels. Each property perturbs the image by ``ε`` (the mask channel fixed) and asks
whether the count can drop to ``k`` (VNN-LIB ``Y_0 <= k``: ``sat`` if it can). The table gives each instance's
verdict, the count's bounds from IBP and CROWN at the root, the time, and whether a ``sat`` counterexample replays
in onnxruntime.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedshard.bench.planted import export_onnx, onnx_forward
from lightning_fedshard.verify import Verdict, VerifyConfig, load_onnx, read_vnnlib, verify_files
from lightning_fedshard.verify.bounds.crown import backward_bound, intermediate_bounds
from lightning_fedshard.verify.ops import Interval

__all__ = ["INSTANCES", "SHAPE", "CountingUNet", "export_counting_net", "write_count_vnnlib"]

#: Input: 3 image channels and the mask channel, 16×16.
SHAPE = (4, 16, 16)
PIXELS = SHAPE[1] * SHAPE[2]
#: ``(name, ε, k)``: the image perturbed by ε, unsafe when the count of agreeing pixels is at most k.
INSTANCES = (
    ("eps0.002_k250", 0.002, PIXELS - 6),
    ("eps0.005_k240", 0.005, PIXELS - 16),
    ("eps0.01_k200", 0.01, PIXELS - 56),
    ("eps0.01_k245", 0.01, PIXELS - 11),  # CROWN's count bound is 240: only branching can settle it
    ("eps0.05_k255", 0.05, PIXELS - 1),
    ("eps0.2_k240", 0.2, PIXELS - 16),
)


class CountingUNet(nn.Module):
    """A two-level UNet on ``x [N, 4, H, W]`` (image ``x[:, :3]``, mask ``x[:, 3]``) returning how many pixels it
    predicts as the mask says (class 1 where the mask is 1).

    Example::

        net = CountingUNet(seed=0)
        net(torch.zeros(1, 4, 16, 16))   # a float count in [0, 256]
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.middle = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.head = nn.Conv2d(4 + 3, 2, 3, padding=1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        image = x[:, :3]
        hidden = F.relu(self.middle(F.relu(self.down(image))))
        return self.head(torch.cat([F.relu(self.up(hidden)), image], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        predicted = F.one_hot(self.logits(x).argmax(1), 2).permute(0, 3, 1, 2).float()
        return (predicted[:, 1] == x[:, 3]).float().sum()


def export_counting_net(folder: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """The net's ONNX in ``folder`` and a box centre ``[4, 16, 16]`` whose mask is the net's prediction there."""
    folder.mkdir(parents=True, exist_ok=True)
    net = CountingUNet(seed).eval()
    path = folder / "counting_unet.onnx"
    export_onnx(net, SHAPE, path)
    centre = np.random.default_rng(seed).uniform(0, 1, SHAPE).astype(np.float32)
    with torch.no_grad():
        centre[3] = net.logits(torch.from_numpy(centre)[None])[0].argmax(0).float().numpy()
    return path, centre


def write_count_vnnlib(path: Path, centre: np.ndarray, epsilon: float, k: int) -> Path:
    """The image channels of ``centre`` ± ``epsilon`` (the mask channel fixed) and the unsafe set ``Y_0 <= k``."""
    lower, upper = centre.copy(), centre.copy()
    lower[:3] -= epsilon
    upper[:3] += epsilon
    lines = [f"; counting UNet: eps {epsilon}, unsafe count <= {k}"]
    lines += [f"(declare-const X_{i} Real)" for i in range(centre.size)] + ["(declare-const Y_0 Real)"]
    for i, (low, high) in enumerate(zip(lower.ravel(), upper.ravel(), strict=True)):
        lines += [f"(assert (>= X_{i} {float(low)!r}))", f"(assert (<= X_{i} {float(high)!r}))"]
    lines.append(f"(assert (<= Y_0 {k}))")
    path.write_text("\n".join(lines) + "\n")
    return path


def root_bounds(onnx_path: Path, vnnlib_path: Path) -> dict[str, tuple[float, float]]:
    """The count's IBP and CROWN bounds over the property's box."""
    graph = load_onnx(onnx_path)
    (case,) = read_vnnlib(vnnlib_path, graph.input.size, graph.output.size).cases
    box = Interval(
        torch.tensor(case.box.lower, dtype=torch.float32).view(1, *graph.input.shape),
        torch.tensor(case.box.upper, dtype=torch.float32).view(1, *graph.input.shape),
    )
    ibp = graph.ibp(box)[graph.output.name]
    C = torch.tensor([1.0, -1.0]).view(2, 1)
    crown = backward_bound(graph, graph.output.name, C, box, intermediate_bounds(graph, box)).lower[:, 0]
    return {"ibp": (float(ibp.lower), float(ibp.upper)), "crown": (float(crown[0]), float(-crown[1]))}


def run(folder: Path, timeout: float) -> list[dict]:
    onnx_path, centre = export_counting_net(folder)
    model = onnx_forward(onnx_path)
    rows = []
    # The set as VNN-COMP lists one (onnx,vnnlib,timeout), for other tools to run the same instances.
    listed = [f"{onnx_path.name},{name}.vnnlib,{timeout:g}" for name, _, _ in INSTANCES]
    (folder / "instances.csv").write_text("\n".join(listed) + "\n")
    for name, epsilon, k in INSTANCES:
        vnnlib_path = write_count_vnnlib(folder / f"{name}.vnnlib", centre, epsilon, k)
        bounds = root_bounds(onnx_path, vnnlib_path)
        start = time.monotonic()
        result = verify_files(onnx_path, vnnlib_path, VerifyConfig(timeout=timeout))
        seconds = time.monotonic() - start
        replayed = None
        if result.verdict is Verdict.SAT:
            count = float(model(result.counterexample.x)[0])
            replayed = count <= k
        rows.append(
            {
                "name": name,
                "eps": epsilon,
                "k": k,
                "verdict": result.verdict.value,
                "seconds": seconds,
                "replays": replayed,
                "reason": result.reason,
                **bounds,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| instance | ε | unsafe if count ≤ | verdict | count by IBP | count by CROWN | time (s) | cex replays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ibp, crown = row["ibp"], row["crown"]
        replays = "—" if row["replays"] is None else ("yes" if row["replays"] else "NO")
        lines.append(
            f"| {row['name']} | {row['eps']} | {row['k']} | {row['verdict']} | [{ibp[0]:.2f}, {ibp[1]:.2f}] | "
            f"[{crown[0]:.2f}, {crown[1]:.2f}] | {row['seconds']:.1f} | {replays} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench counting", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per instance")
    parser.add_argument("--out", type=Path, default=Path("runs/counting"))
    args = parser.parse_args(argv)
    rows = run(args.out, args.timeout)
    table = format_table(rows)
    print(table)
    (args.out / "counting.md").write_text(table + "\n")
