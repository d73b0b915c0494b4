"""A small vision-transformer instance set, exported at several opsets (no download): the operators of VNN-COMP
2025's ViT benchmark — patch embedding by Conv, a class token by Concat, LayerNorm as ReduceMean/Sub/Pow/Sqrt/Div,
attention as a MatMul of two computed tensors and Softmax — in the forms opset 9, 13 and 17 exporters write.

    fedshard bench vit --out runs/vit                      # writes onnx/, vnnlib/, instances.csv
    fedshard verify --instances runs/vit/instances.csv --threads 1 --results runs/vit/ours.csv

The net is trained for a few seconds (seeded) to tell which third of an 8×8 image is brightest; each property is
the robustness of a correctly classified test image within ±ε, over a ladder of ε. The same weights are exported at
every opset, so the verdicts must not depend on the opset.
"""

from __future__ import annotations

import argparse
import csv
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lightning_fedshard.bench.planted import write_robustness_vnnlib

__all__ = ["TinyViT", "export_at", "main", "train_vit", "write_vit_set"]

CLASSES = 3
IMAGE = (1, 8, 8)


class LayerNorm(nn.Module):
    """LayerNorm written as ReduceMean, Sub, Pow, Sqrt and Div (as exporters before opset 17 emit it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.bias = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias


class EncoderBlock(nn.Module):
    """Pre-norm single-head self-attention (a MatMul of two computed tensors, Softmax) and a ReLU MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = LayerNorm(width), LayerNorm(width)
        self.query, self.key, self.value, self.out = (nn.Linear(width, width) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        scores = self.query(h) @ self.key(h).transpose(-1, -2) / h.shape[-1] ** 0.5
        x = x + self.out(torch.softmax(scores, dim=-1) @ self.value(h))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A 2-layer vision transformer on 1×8×8 images: 4×4 patches embedded by a Conv, a class token by Concat,
    learned positions, the class token's output through a linear head.

    Example::

        vit = TinyViT()
        logits = vit(torch.rand(5, 1, 8, 8))   # [5, 3]
    """

    def __init__(self, width: int = 8, classes: int = CLASSES) -> None:
        super().__init__()
        self.patches = nn.Conv2d(1, width, 4, 4)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, width))
        self.positions = nn.Parameter(0.1 * torch.randn(1, 5, width))
        self.blocks = nn.Sequential(EncoderBlock(width), EncoderBlock(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], 1) + self.positions
        return self.head(self.blocks(tokens)[:, 0])


def export_at(net: nn.Module, shape: tuple[int, ...], opset: int, path: Path) -> Path:
    """``net`` through the TorchScript exporter at ``opset``, shape arithmetic unfolded and a symbolic batch (so
    the graph keeps its Shape → Gather → Unsqueeze → Concat chains, in the opset's form, as PyTorch 2.0 exported
    ViTs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and opset notices
        torch.onnx.export(
            net.eval(),
            torch.zeros(1, *shape),
            str(path),
            opset_version=opset,
            dynamo=False,
            do_constant_folding=False,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    return path


def brightest_third(images: torch.Tensor) -> torch.Tensor:
    """The task's label: which band of columns (0–2, 3–4, 5–7) has the highest mean intensity."""
    bands = [images[..., :3], images[..., 3:5], images[..., 5:]]
    return torch.stack([band.mean((1, 2, 3)) for band in bands], 1).argmax(1)


def train_vit(seed: int = 0, steps: int = 300) -> TinyViT:
    """A :class:`TinyViT` trained with Adam on random images labelled by :func:`brightest_third`."""
    torch.manual_seed(seed)
    vit = TinyViT()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(vit.parameters(), lr=1e-2)
    for _ in range(steps):
        images = torch.rand(64, *IMAGE, generator=generator)
        loss = nn.functional.cross_entropy(vit(images), brightest_third(images))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return vit.eval()


def write_vit_set(
    folder: Path,
    opsets: tuple[int, ...] = (9, 13, 17),
    epsilons: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1),
    images: int = 3,
    timeout: float = 60.0,
    seed: int = 0,
) -> Path:
    """Write the set into ``folder`` (``onnx/``, ``vnnlib/``, ``instances.csv`` with paths relative to it): one
    trained ViT at each opset, and a robustness property per correctly classified test image and ε. Returns the
    instances CSV."""
    (folder / "onnx").mkdir(parents=True, exist_ok=True)
    (folder / "vnnlib").mkdir(exist_ok=True)
    vit = train_vit(seed)
    test = torch.rand(64, *IMAGE, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        correct = (vit(test).argmax(1) == brightest_third(test)).nonzero().reshape(-1)[:images]
    properties = []
    for index in correct.tolist():
        label = int(brightest_third(test[index : index + 1])[0])
        centre = test[index].numpy().reshape(-1).astype(np.float64)
        for epsilon in epsilons:
            name = f"vnnlib/image{index}_eps{epsilon:g}.vnnlib"
            write_robustness_vnnlib(folder / name, centre, label, f"tiny ViT, image {index}", epsilon, CLASSES)
            properties.append(name)
    rows = []
    for opset in opsets:
        net = f"onnx/vit_opset{opset}.onnx"
        export_at(vit, IMAGE, opset, folder / net)
        rows += [(net, name, f"{timeout:g}") for name in properties]
    instances = folder / "instances.csv"
    with instances.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return instances


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench vit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the set into")
    parser.add_argument("--opsets", type=int, nargs="+", default=[9, 13, 17])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1])
    parser.add_argument("--images", type=int, default=3, help="test images (properties per ε)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per instance (instances.csv)")
    args = parser.parse_args(argv)
    instances = write_vit_set(args.out, tuple(args.opsets), tuple(args.epsilons), args.images, args.timeout)
    print(f"wrote {instances}: verify with  fedshard verify --instances {instances} --threads 1 --results OUT.csv")
