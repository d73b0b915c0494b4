"""Large synthetic networks for the memory-budget and deadline benchmark, built and exported here (no download):
the shapes of the VNN-COMP 2022–2024 nets that overran memory and deadlines, with random weights.

    path = export_net("generator", Path("/tmp/nets"))   # ONNX + a VNN-LIB property next to it

Each net has a property whose box is small around an input (ε), so that every phase of the verifier runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lightning_fedshard.bench.planted import export_onnx, write_robustness_vnnlib

__all__ = ["LARGE_NETS", "export_net"]


class _Sign(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)


def _generator() -> tuple[nn.Module, tuple[int, ...]]:
    """A DCGAN-style generator (latent 16 → 3×64×64 by four transposed convolutions) followed by a small
    discriminator head, as in VNN-COMP 2023's cgan benchmark."""
    net = nn.Sequential(
        nn.Linear(16, 128 * 4 * 4),
        nn.ReLU(),
        nn.Unflatten(1, (128, 4, 4)),
        nn.ConvTranspose2d(128, 64, 4, 2, 1),
        nn.ReLU(),
        nn.ConvTranspose2d(64, 32, 4, 2, 1),
        nn.ReLU(),
        nn.ConvTranspose2d(32, 16, 4, 2, 1),
        nn.ReLU(),
        nn.ConvTranspose2d(16, 3, 4, 2, 1),
        nn.Conv2d(3, 8, 4, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 16 * 16, 2),
    )
    return net, (16,)


def _sign_cnn() -> tuple[nn.Module, tuple[int, ...]]:
    """A 3×64×64 CNN with Sign activations and max pooling (VNN-COMP 2024's traffic-sign nets)."""
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1),
        _Sign(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, 1, 1),
        _Sign(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, 1, 1),
        _Sign(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 43),
    )
    return net, (3, 64, 64)


def _yolo() -> tuple[nn.Module, tuple[int, ...]]:
    """A TinyYOLO-sized CNN on 3×128×128 (about a million activations), ending in a small box-score head."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 64, 128):
        layers += [nn.Conv2d(channels, width, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2)]
        channels = width
    layers += [nn.Conv2d(channels, 16, 1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 5)]
    return nn.Sequential(*layers), (3, 128, 128)


#: name -> builder of (module, input shape without the batch), and the box radius of its property.
LARGE_NETS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple[int, ...]]], float]] = {
    "generator": (_generator, 0.05),
    "sign_cnn": (_sign_cnn, 1e-4),
    "yolo": (_yolo, 1e-4),
}


def export_net(name: str, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(onnx, vnnlib)`` of net ``name`` in ``folder``: random weights (``seed``), and the property "the output that
    is largest at a random input stays the largest" over an ε-box around that input (the net's ε in
    :data:`LARGE_NETS`)."""
    build, epsilon = LARGE_NETS[name]
    torch.manual_seed(seed)
    net, shape = build()
    folder.mkdir(parents=True, exist_ok=True)
    onnx_path, vnnlib_path = folder / f"{name}.onnx", folder / f"{name}.vnnlib"
    export_onnx(net, shape, onnx_path)
    centre = np.random.default_rng(seed).uniform(0, 1, int(np.prod(shape)))
    with torch.no_grad():
        scores = net(torch.as_tensor(centre, dtype=torch.float32).view(1, *shape))[0]
    label = int(scores.argmax())
    write_robustness_vnnlib(vnnlib_path, centre, label, f"{name}, seed {seed}", epsilon, scores.numel())
    return onnx_path, vnnlib_path
