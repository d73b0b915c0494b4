"""Patches-mode coefficients: every operation against its dense counterpart on random data, the to_dense
conversion against a loop, and on a small conv ResNet the patches-mode intermediate and final CROWN bounds against
the dense (matrix) ones, their soundness on sampled points, and the memory they save on a 32 × 32 input."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fedshard.verify.bounds.crown import backward_bound, intermediate_bounds, selection_rows
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.memory import PeakMemoryMeter
from lightning_fedshard.verify.ops import (
    Add,
    AvgPool2d,
    BatchNorm,
    Conv2d,
    ElementwiseAffine,
    Interval,
    Linear,
    Patches,
    ReLU,
    Reshape,
    chunks,
    contract,
)
from tests.verify.nets import resnet as build_resnet

DTYPE = torch.float64  # the equivalence checks compare two exact rewritings, so rounding must not hide a mistake
BATCH = 2


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv(in_shape, out_channels, kernel=(3, 3), seed=0, **kwargs) -> Conv2d:
    gen = _gen(seed)
    groups = kwargs.get("groups", 1)
    weight = torch.randn(out_channels, in_shape[0] // groups, *kernel, generator=gen, dtype=DTYPE)
    return Conv2d(weight, torch.randn(out_channels, generator=gen, dtype=DTYPE), in_shape, **kwargs)


def _out_shape(op, in_shape) -> tuple[int, ...]:
    return tuple(op.forward(torch.zeros(1, *in_shape, dtype=DTYPE)).shape[1:])


def _rows(shape, count=7, seed=0) -> Patches:
    """``2·count`` identity Patches rows at random positions of a node of ``shape``."""
    index = torch.randperm(math.prod(shape), generator=_gen(seed))[:count].sort().values
    return Patches.identity(index, BATCH, shape, DTYPE)


def _random_patches(shape, seed=0) -> Patches:
    """Random windows on a node of ``shape``: identity rows on a node after it, through a random 3 × 3 conv."""
    conv = _conv(shape, 4, seed=seed, pads=(1, 1, 1, 1))
    return conv.transpose(_rows(_out_shape(conv, shape), seed=seed))


def _close(actual, expected) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- representation


def test_identity_is_selection_rows():
    index = torch.tensor([0, 5, 37, 71])
    dense = selection_rows(index, BATCH, (3, 4, 6), DTYPE)
    _close(Patches.identity(index, BATCH, (3, 4, 6), DTYPE).to_dense(), dense)


def test_to_dense_matches_a_loop():
    gen = _gen(1)
    shape, positions = (2, 5, 6), torch.tensor([[0, 0], [2, 1], [4, 5], [1, 3]])
    values = torch.randn(4, BATCH, 2, 4, 3, generator=gen, dtype=DTYPE)
    patches = Patches(values, positions, (2, 1), (1, 2), shape)
    expected = torch.zeros(4, BATCH, *shape, dtype=DTYPE)
    for s, (h, w) in enumerate(positions.tolist()):
        for i in range(4):
            for j in range(3):
                y, x = h * 2 - 1 + i, w - 2 + j
                if 0 <= y < shape[1] and 0 <= x < shape[2]:
                    expected[s, :, :, y, x] = values[s, :, :, i, j]
    _close(patches.to_dense(), expected)


CONVS = {
    "k3_s1_p1": {"pads": (1, 1, 1, 1)},
    "k3_s1_p0": {},
    "k3_s2_p1": {"stride": (2, 2), "pads": (1, 1, 1, 1)},
    "k2_s2_remainder": {"kernel": (2, 2), "stride": (2, 2)},
    "asymmetric_pads": {"pads": (0, 1, 2, 1)},
    "asymmetric_s2": {"stride": (2, 2), "pads": (0, 1, 1, 0)},
    "rect_kernel": {"kernel": (2, 3), "stride": (1, 2), "pads": (1, 1, 1, 1)},
    "dilation2": {"dilation": (2, 2), "pads": (2, 2, 2, 2)},
    "groups2": {"groups": 2, "pads": (1, 1, 1, 1)},
}


@pytest.mark.parametrize("second", list(CONVS))
@pytest.mark.parametrize("first", ["k3_s1_p1", "k3_s2_p1", "asymmetric_s2"])
def test_two_convs_compose_like_the_dense_transpose(first, second):
    in_shape = (4, 13, 12)
    conv1 = _conv(in_shape, 4, seed=1, **CONVS[first])
    mid = _out_shape(conv1, in_shape)
    conv2 = _conv(mid, 6, seed=2, **CONVS[second])
    rows = _rows(_out_shape(conv2, mid))
    patches = conv1.transpose(conv2.transpose(rows))
    # dilated windows after a stride-2 conv (11 × 11) cover most of the 13 × 12 image: dense (DENSE_FILL)
    assert isinstance(patches, Patches) == (second != "dilation2" or first == "k3_s1_p1")
    dense = patches.to_dense() if isinstance(patches, Patches) else patches
    _close(dense, conv1.transpose(conv2.transpose(rows.to_dense())))
    _close(contract(patches, conv1.constant()), contract(dense, conv1.constant()))


def test_windows_larger_than_the_image_turn_dense():
    conv = _conv((2, 3, 3), 2, kernel=(3, 3), pads=(1, 1, 1, 1))
    rows = conv.transpose(_rows((2, 3, 3)))  # 3 × 3 windows on a 3 × 3 image
    dense = conv.transpose(rows)
    assert isinstance(dense, torch.Tensor)
    _close(dense, conv.transpose(conv.transpose(_rows((2, 3, 3)).to_dense())))


STEP_CONVS = {
    **CONVS,
    "dilation2_groups2": {"dilation": (2, 2), "groups": 2, "pads": (2, 2, 2, 2)},
    "depthwise_s2_asymmetric": {"groups": 4, "stride": (2, 2), "pads": (0, 1, 1, 0)},
    "dilation_s2_rect": {"kernel": (2, 3), "stride": (2, 1), "dilation": (2, 1), "pads": (1, 0, 0, 2)},
    "one_d": {"kernel": (1, 3), "stride": (1, 2), "pads": (0, 1, 0, 0)},  # a 1-D conv as the loader builds it
}


def _jacobian(op: Conv2d, in_shape) -> torch.Tensor:
    """``[out size, in size]``: the convolution as a dense fp64 matrix, by differentiating the forward map."""
    x = torch.zeros(math.prod(in_shape), dtype=DTYPE)
    return torch.autograd.functional.jacobian(lambda v: op.linear(v.view(1, *in_shape)).flatten(), x)


@pytest.mark.parametrize("kwargs", list(STEP_CONVS.values()), ids=list(STEP_CONVS))
def test_patches_steps_equal_the_dense_transposed_conv(kwargs):
    # Each step against an independent fp64 reference: the coefficients times the convolution's Jacobian. The first
    # step takes 1 × 1 windows (a matrix product with the kernel), the second wider ones (a transposed convolution).
    in_shape = (4, 9, 11) if kwargs is not STEP_CONVS["one_d"] else (4, 1, 11)
    first = _conv(in_shape, 4, seed=3, **kwargs)
    mid = _out_shape(first, in_shape)
    second = _conv(mid, 8, seed=4, **kwargs)
    rows = _rows(_out_shape(second, mid), count=9)
    dense_rows = rows.to_dense().flatten(2)
    through_second = second.transpose(rows)
    expected = (dense_rows @ _jacobian(second, mid)).view(*dense_rows.shape[:2], *mid)
    _close(through_second.to_dense() if isinstance(through_second, Patches) else through_second, expected)
    through_both = first.transpose(through_second)
    expected = (expected.flatten(2) @ _jacobian(first, in_shape)).view(*dense_rows.shape[:2], *in_shape)
    _close(through_both.to_dense() if isinstance(through_both, Patches) else through_both, expected)


def test_windows_covering_most_of_the_image_turn_dense():
    # 3 × 3 windows through a stride-2 3 × 3 kernel: 7 × 7 windows, on a 7 × 7 image dense (always), on an 8 × 8 one
    # (0.77 of it) dense too, on a 9 × 9 one (0.60) still patches.
    for size, dense in ((7, True), (8, True), (9, False)):
        conv = _conv((2, size, size), 3, stride=(2, 2), pads=(1, 1, 1, 1))
        rows = _rows(_out_shape(conv, (2, size, size)))
        windows = Patches(
            rows.values.expand(-1, -1, -1, 3, 3).contiguous(), rows.positions, (1, 1), (1, 1), rows.node_shape
        )
        out = conv.transpose(windows._zero_outside())
        assert isinstance(out, torch.Tensor) == dense, size
        _close(out if dense else out.to_dense(), conv.transpose(windows.to_dense()))


def test_element_wise_work_in_many_chunks(monkeypatch):
    # Chunks of a few rows each: products with per-pixel values, per-pixel and per-channel sums and Σ |A|·w equal
    # those of the dense coefficients.
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunks, "WHOLE_BYTES", 4096)
    shape = (4, 6, 7)
    conv = _conv(shape, 4, seed=8, pads=(1, 1, 1, 1))
    patches = conv.transpose(_rows(_out_shape(conv, shape), count=40))
    assert len(patches._row_chunks(8)) > 10
    weights = torch.rand(BATCH, *shape, generator=_gen(9), dtype=DTYPE)
    for value in (weights, torch.randn(4, 1, 1, dtype=DTYPE)):
        _close(contract(patches, value), contract(patches.to_dense(), value))
        _close((patches * value).to_dense(), patches.to_dense() * value)
    _close(patches.contract(weights, magnitudes=True), contract(patches.to_dense().abs(), weights))
    dense = patches.to_dense()
    _close(contract(dense, weights), (dense * weights).sum((2, 3, 4)))
    per_row = torch.randn(dense.shape, generator=_gen(10), dtype=DTYPE)  # per-row intercepts (α's lines)
    _close(contract(dense, per_row), (dense * per_row).sum((2, 3, 4)))


# --------------------------------------------------------------------------- element-wise operations


def _bounds(shape, seed=0) -> Interval:
    gen = _gen(seed)
    center = torch.randn(BATCH, *shape, generator=gen, dtype=DTYPE)
    radius = torch.rand(BATCH, *shape, generator=gen, dtype=DTYPE)
    return Interval(center - radius, center + radius)


def _check_backward(op, A: Patches, inputs) -> None:
    """``op.backward`` on Patches equals it on the dense coefficients (and stays Patches)."""
    assert op.accepts_patches
    patches_out, patches_bias = op.backward(A, inputs)
    dense_out, dense_bias = op.backward(A.to_dense(), inputs)
    for p, d in zip(patches_out, dense_out, strict=True):
        assert isinstance(p, Patches)
        _close(p.to_dense(), d)
    if dense_bias is None:
        assert patches_bias is None
    else:
        _close(patches_bias, dense_bias)


def test_relu_relaxation():
    shape = (4, 6, 7)
    _check_backward(ReLU(), _random_patches(shape), [_bounds(shape)])


def test_batchnorm():
    gen, shape = _gen(3), (4, 6, 7)
    gamma, beta, mean = (torch.randn(4, generator=gen, dtype=DTYPE) for _ in range(3))
    bn = BatchNorm(gamma, beta, mean, torch.rand(4, generator=gen, dtype=DTYPE) + 0.1, 1e-5, shape)
    _check_backward(bn, _random_patches(shape), [_bounds(shape)])


@pytest.mark.parametrize("constant_shape", [(4, 6, 7), (1, 4, 6, 7), (4, 1, 7), (7,), ()])
def test_elementwise_affine(constant_shape):
    gen, shape = _gen(4), (4, 6, 7)
    scale, shift = (torch.randn(constant_shape, generator=gen, dtype=DTYPE) for _ in range(2))
    _check_backward(ElementwiseAffine(scale, shift, shape, shape), _random_patches(shape), [_bounds(shape)])


def test_contract_with_per_pixel_and_batched_values():
    shape = (4, 6, 7)
    patches = _random_patches(shape)
    for value in (torch.randn(BATCH, *shape, dtype=DTYPE), torch.randn(shape, dtype=DTYPE), torch.tensor(2.0)):
        _close(contract(patches, value), contract(patches.to_dense(), value))
    _close(contract(patches.abs(), value), contract(patches.to_dense().abs(), value))


def test_add_fork_with_different_windows():
    # The skip branch arrives with the start's 1 × 1 windows, the conv branch with 3 × 3 ones (stride 1).
    shape = (4, 6, 7)
    conv = _conv(shape, 4, seed=5, pads=(0, 1, 2, 1))
    rows = _rows(_out_shape(conv, shape))
    through_conv = conv.transpose(rows)
    assert through_conv.values.shape[3:] != rows.values.shape[3:]
    total = through_conv + rows
    assert isinstance(total, Patches)
    _close(total.to_dense(), through_conv.to_dense() + rows.to_dense())
    _close((-through_conv + rows).to_dense(), rows.to_dense() - through_conv.to_dense())
    (A_a, A_b), _ = Add(subtract=True).backward(total, [_bounds(shape), _bounds(shape)])
    _close(A_a.to_dense() + A_b.to_dense(), torch.zeros_like(total.to_dense()))


def test_sum_on_different_grids_or_with_dense_coefficients_is_dense():
    shape, positions = (2, 6, 7), torch.tensor([[0, 0], [1, 2], [2, 1]])
    values = torch.randn(3, BATCH, 2, 1, 1, generator=_gen(6), dtype=DTYPE)
    a, b = Patches(values, positions, (1, 1), (0, 0), shape), Patches(values, positions, (2, 1), (0, 0), shape)
    for x, y in ((a, b), (a, b.to_dense()), (a.to_dense(), b)):
        total = x + y
        assert isinstance(total, torch.Tensor)
        _close(total, a.to_dense() + b.to_dense())


POOLS = {
    "k2_s2": {"kernel": (2, 2), "stride": (2, 2)},
    "k3_s2_pad_include": {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1), "count_include_pad": True},
    "k3_s1_exclude_nopad": {"kernel": (3, 3), "stride": (1, 1)},
    "k2_s2_ceil_exact": {"kernel": (2, 2), "stride": (2, 2), "ceil_mode": True},  # 8 × 8: no window hangs over
}


@pytest.mark.parametrize("kwargs", list(POOLS.values()), ids=list(POOLS))
def test_avgpool_composes_like_a_depthwise_conv(kwargs):
    in_shape = (3, 8, 8)
    pool = AvgPool2d(in_shape, **kwargs)
    rows = _rows(_out_shape(pool, in_shape))
    _check_backward(pool, rows, [_bounds(in_shape)])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1), "count_include_pad": False},
        {"kernel": (2, 2), "stride": (2, 2), "ceil_mode": True},  # 7 × 7: the last window hangs over the edge
    ],
    ids=["pad_exclude", "ceil_mode"],
)
def test_avgpool_with_uneven_divisors_takes_dense_coefficients(kwargs):
    assert not AvgPool2d((3, 7, 7), **kwargs).accepts_patches


def test_dense_only_ops():
    assert not Reshape((4, 6, 7), (168,)).accepts_patches
    assert not Linear(torch.randn(3, 7)).accepts_patches
    assert not ElementwiseAffine(torch.randn(4, 6, 7), None, (4, 1, 7), (4, 6, 7)).accepts_patches


# --------------------------------------------------------------------------- a conv ResNet


def _box(graph: BoundGraph, eps: float, batch: int = BATCH, dtype=DTYPE) -> Interval:
    center = torch.rand(batch, *graph.input.shape, generator=_gen(7), dtype=dtype)
    return Interval(center - eps, center + eps)


def _spec(batch: int = BATCH, dtype=DTYPE) -> torch.Tensor:
    """9 rows ``y_label − y_j`` (label 0)."""
    C = torch.zeros(9, 10, dtype=dtype)
    C[:, 0] = 1
    C[torch.arange(9), torch.arange(1, 10)] = -1
    return C.unsqueeze(1).expand(9, batch, 10)


def _assert_same_bounds(got: dict[str, Interval], want: dict[str, Interval]) -> None:
    # Equal up to float32 summation order, and up to the rounding charge (at most 0.02 here), which each mode sums
    # in its own float32 product and scales up by its own γ of the terms: up to 0.2 % of it apart.
    assert set(got) == set(want)
    for name, interval in got.items():
        for a, b in ((interval.lower, want[name].lower), (interval.upper, want[name].upper)):
            assert ((a - b).abs() <= 4e-5 * (1 + b.abs())).all(), name


@pytest.fixture(scope="module")
def resnet():
    graph, dtype = build_resnet(), torch.float32
    box = _box(graph, 0.01, dtype=dtype)
    patches = intermediate_bounds(graph, box, conv_mode="patches")
    matrix = intermediate_bounds(graph, box, conv_mode="matrix")
    return graph, box, patches, matrix


def test_resnet_patches_bounds_equal_matrix_bounds(resnet):
    graph, box, patches, matrix = resnet
    ibp = graph.ibp(box)
    # CROWN tightened the conv pre-activations, so both modes really ran there.
    assert all((patches[pre].lower > ibp[pre].lower).any() for pre in ("block_a_bn", "sum", "down"))
    _assert_same_bounds(patches, matrix)
    C = _spec(dtype=torch.float32)
    lower_p = backward_bound(graph, "fc2", C, box, patches).lower
    lower_m = backward_bound(graph, "fc2", C, box, matrix).lower
    assert ((lower_p - lower_m).abs() <= 1e-5 * (1 + lower_m.abs())).all()


def test_resnet_patches_pass_reaches_the_input_as_patches(resnet):
    graph, box, patches, _ = resnet
    rows = Patches.identity(torch.arange(0, 512, 37), BATCH, graph.by_name["sum"].shape, torch.float32)
    result = backward_bound(graph, "sum", rows, box, patches)
    assert isinstance(result.input_A, Patches)
    dense = backward_bound(graph, "sum", rows.to_dense(), box, patches)
    torch.testing.assert_close(result.input_A.to_dense(), dense.input_A, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.minimiser(box), dense.minimiser(box))


def test_resnet_patches_bounds_are_sound(resnet):
    graph, box, bounds, _ = resnet
    points = box.lower + (box.upper - box.lower) * torch.rand(500, *box.lower.shape, generator=_gen(8))
    points[:2] = torch.stack([box.lower, box.upper])
    values = {graph.input.name: points.flatten(0, 1)}
    for node in graph.nodes[1:]:
        values[node.name] = node.op.forward(*(values[name] for name in node.inputs))
    for name, interval in bounds.items():
        value = values[name].view(500, *interval.lower.shape)
        tol = 1e-5 * (1 + value.abs())
        assert ((value >= interval.lower - tol) & (value <= interval.upper + tol)).all(), name
    C = _spec(dtype=torch.float32)
    lower = backward_bound(graph, "fc2", C, box, bounds).lower
    spec_values = torch.einsum("sbk,nbk->nsb", C, values["fc2"].view(500, BATCH, 10))
    assert (spec_values >= lower - 1e-5 * (1 + spec_values.abs())).all()


# --------------------------------------------------------------------------- memory


def test_patches_mode_needs_far_less_memory_on_a_32x32_input():
    graph = build_resnet((3, 32, 32), width=16)
    box = _box(graph, 0.01, batch=1, dtype=torch.float32)
    # The same 200 neurons of every conv pre-activation in both modes (so that the dense run stays small), and
    # 4 of fc1, whose pass is dense in both modes.
    gen = _gen(9)
    rows = {pre: torch.randperm(graph.by_name[pre].size, generator=gen)[:200] for pre in ("block_a_bn", "sum", "down")}
    rows["fc1"] = torch.arange(4)
    peaks, results = {}, {}
    for mode in ("patches", "matrix"):
        with torch.no_grad(), PeakMemoryMeter() as meter:
            results[mode] = intermediate_bounds(graph, box, rows=rows, conv_mode=mode)
        peaks[mode] = meter.peak_bytes
    assert peaks["matrix"] >= 5 * peaks["patches"], f"peak bytes {peaks}"
    _assert_same_bounds(results["patches"], results["matrix"])
