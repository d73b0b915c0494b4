"""Small hand-built verification graphs for the tests: a builder that reads every node's shape off its op, and a
conv ResNet with BatchNorm and a residual add."""

from __future__ import annotations

import itertools
import math

import torch

from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.ops import Add, AvgPool2d, BatchNorm, Conv2d, Linear, ReLU, Reshape


class GraphBuilder:
    """Appends nodes to a graph; each node's shape is read off its op's forward on zeros, so the shapes stored in
    the graph are what the ops really produce. Weights are Gaussian, scaled by ``1/√fan_in``."""

    def __init__(self, seed: int, input_shape: tuple[int, ...]) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.nodes = [Node("x", None, (), input_shape)]
        self.shapes = {"x": input_shape}

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen)

    def add(self, name: str, op, *inputs: str) -> str:
        inputs = inputs or (self.nodes[-1].name,)
        out = op.forward(*(torch.zeros(1, *self.shapes[i]) for i in inputs))
        self.shapes[name] = tuple(out.shape[1:])
        self.nodes.append(Node(name, op, inputs, self.shapes[name]))
        return name

    def linear(self, name: str, out: int, *inputs: str) -> str:
        fan_in = self.shapes[inputs[0] if inputs else self.nodes[-1].name][-1]
        return self.add(name, Linear(self.randn(out, fan_in, scale=fan_in**-0.5), self.randn(out, scale=0.3)), *inputs)

    def conv(self, name: str, out: int, kernel: tuple[int, int], **kwargs) -> str:
        in_shape = self.shapes[self.nodes[-1].name]
        fan_in = in_shape[0] // kwargs.get("groups", 1)
        weight = self.randn(out, fan_in, *kernel, scale=(fan_in * math.prod(kernel)) ** -0.5)
        return self.add(name, Conv2d(weight, self.randn(out, scale=0.3), in_shape, **kwargs))

    def flatten(self, name: str) -> str:
        shape = self.shapes[self.nodes[-1].name]
        return self.add(name, Reshape(shape, (math.prod(shape),)))

    def batchnorm(self, name: str) -> str:
        shape = self.shapes[self.nodes[-1].name]
        channels = shape[0]
        gamma = self.randn(channels) * 1.5  # some negative: the per-channel scale flips the interval
        mean, var = self.randn(channels, scale=0.5), self.rand(channels) * 2 + 0.1
        return self.add(name, BatchNorm(gamma, self.randn(channels, scale=0.3), mean, var, 1e-5, shape))

    def graph(self) -> BoundGraph:
        return BoundGraph(self.nodes)


def resnet(input_shape: tuple[int, int, int] = (3, 16, 16), width: int = 8, seed: int = 0) -> BoundGraph:
    """conv-bn-relu, one residual block, a strided conv, 2 × 2 average pooling, flatten, linear-relu-linear."""
    b = GraphBuilder(seed, input_shape)
    same = {"pads": (1, 1, 1, 1)}
    b.conv("stem", width, (3, 3), **same), b.batchnorm("stem_bn"), b.add("stem_relu", ReLU())
    b.conv("block_a", width, (3, 3), **same), b.batchnorm("block_a_bn"), b.add("block_relu", ReLU())
    b.conv("block_b", width, (3, 3), **same), b.batchnorm("block_b_bn")
    b.add("sum", Add(), "block_b_bn", "stem_relu"), b.add("sum_relu", ReLU())
    b.conv("down", 2 * width, (3, 3), stride=(2, 2), pads=(0, 0, 1, 1)), b.add("down_relu", ReLU())
    b.add("pool", AvgPool2d(b.shapes["down_relu"], (2, 2), (2, 2)))
    b.flatten("flat")
    b.linear("fc1", 32), b.add("fc1_relu", ReLU()), b.linear("fc2", 10)
    return b.graph()


def random_mlp(seed: int, widths: tuple[int, ...]) -> BoundGraph:
    """``fc0 → relu0 → … → fc{L-1}`` with the given widths (input first), Gaussian weights scaled by
    ``1/√fan_in`` and biases of scale 0.3; nodes named ``x``, ``fc{i}``, ``relu{i}``."""
    gen = torch.Generator().manual_seed(seed)
    nodes, previous = [Node("x", None, (), (widths[0],))], "x"
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        weight = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
        nodes.append(Node(f"fc{i}", Linear(weight, torch.randn(fan_out, generator=gen) * 0.3), (previous,), (fan_out,)))
        previous = f"fc{i}"
        if i < len(widths) - 2:
            nodes.append(Node(f"relu{i}", ReLU(), (previous,), (fan_out,)))
            previous = f"relu{i}"
    return BoundGraph(nodes)
