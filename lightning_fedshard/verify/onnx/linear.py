"""Layers with constant weights: Gemm, MatMul (a constant on either side, 1-D operands too, or two computed tensors:
products and a sum), Conv and ConvTranspose (1-D and 2-D), BatchNormalization (inference)."""

from __future__ import annotations

import onnx
import torch

from lightning_fedshard.verify.onnx.common import (
    Converter,
    emit_per_sample,
    emit_product,
    emit_spatial,
    input_name,
    onnx_pads,
    output_name,
    spatial_rank,
    two_d,
)
from lightning_fedshard.verify.onnx.context import LoadContext, NeedsUnbatched, OnnxLoadError, UnsupportedModelError
from lightning_fedshard.verify.ops import BatchNorm, Conv2d, ConvTranspose2d, LeftLinear, Linear, Reduce, Transpose

__all__ = ["LINEAR_CONVERTERS"]


def _gemm(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    x = node.input[0]
    if len(ctx.onnx_shape(x)) != 2:
        raise OnnxLoadError("Gemm needs a 2-D input")
    if attrs.get("transA", 0):
        if ctx.batched:
            raise NeedsUnbatched
        x = ctx.emit(ctx.fresh(f"{output_name(node)}/transA"), Transpose((1, 0), ctx.variable(x).shape), x)
    b = ctx.weight(node.input[1], "Gemm operand B")
    weight = (attrs.get("alpha", 1.0) * (b if attrs.get("transB", 0) else b.T)).contiguous()
    bias = None
    c_name = input_name(node, 2)
    if c_name is not None and attrs.get("beta", 1.0) != 0:
        c = attrs.get("beta", 1.0) * ctx.weight(c_name, "Gemm operand C")
        rows = ctx.onnx_shape(x)[0]
        if c.dim() == 2 and c.shape[0] != 1 and rows != 1:  # a bias per row as well as per column
            name = ctx.emit(ctx.fresh(f"{output_name(node)}/product"), Linear(weight), x)
            ctx.affine(name, None, c, output_name(node))
            return
        bias = c.broadcast_to(1, weight.shape[0]).reshape(-1).clone()
    ctx.emit(output_name(node), Linear(weight, bias), x)


def _matmul(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    left, right = node.input
    if not ctx.is_constant(left) and not ctx.is_constant(right):
        _matmul_of_two(ctx, node)
        return
    x = right if ctx.is_constant(left) else left
    shape = ctx.onnx_shape(x)
    weight = ctx.weight(left if ctx.is_constant(left) else right, "MatMul constant operand")
    while weight.dim() > 2 and weight.shape[0] == 1:  # leading broadcast dimensions of 1
        weight = weight[0]
    if weight.dim() > 2:
        raise UnsupportedModelError(f"MatMul with a constant of shape {list(weight.shape)} (a batch of matrices)")
    if ctx.is_constant(left):  # W @ x over the second-to-last dimension of x
        vector = weight.dim() == 1
        if len(shape) < 2:
            raise UnsupportedModelError(f"MatMul W @ x with x of shape {list(shape)}")
        if ctx.batched and len(shape) == 2:
            raise NeedsUnbatched  # x [1, k]: W's rows would run along the batch
        name = output_name(node) if not vector else ctx.fresh(f"{output_name(node)}/matrix")
        ctx.emit(name, LeftLinear((weight.view(1, -1) if vector else weight).contiguous()), x)
        if vector:  # a 1-D W drops x's second-to-last dimension
            out = ctx.onnx_shape(name)
            ctx.reshape(name, ctx.node_shape((*out[:-2], out[-1])), name=output_name(node))
        return
    if weight.dim() == 1:  # x @ w drops x's last dimension
        name = ctx.emit(ctx.fresh(f"{output_name(node)}/matrix"), Linear(weight.view(1, -1).contiguous()), x)
        ctx.reshape(name, ctx.node_shape(shape[:-1]), name=output_name(node))
        return
    ctx.emit(output_name(node), Linear(weight.T.contiguous()), x)


def _matmul_of_two(ctx: LoadContext, node: onnx.NodeProto) -> None:
    """``X @ Y`` of two computed tensors: every product ``X_ik·Y_kj`` (one bilinear Mul over ``[..., n, k, m]``),
    then the sum over ``k``."""
    left, right = node.input
    a, b = list(ctx.onnx_shape(left)), list(ctx.onnx_shape(right))
    if len(a) < 2 or len(b) < 2:
        raise UnsupportedModelError("MatMul of two computed tensors needs both of rank ≥ 2")
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + a, [1] * (rank - len(b)) + b
    xa = ctx.reshape(left, ctx.node_shape((*a, 1)))  # [..., n, k, 1]
    xb = ctx.reshape(right, ctx.node_shape((*b[:-2], 1, *b[-2:])))  # [..., 1, k, m]
    product = emit_product(ctx, xa, xb, ctx.fresh(f"{output_name(node)}/products"))
    ctx.emit(
        output_name(node),
        Reduce((len(ctx.variable(product).shape) - 2,), ctx.variable(product).shape, keepdims=False),
        product,
    )


def _kernel(
    ctx: LoadContext, node: onnx.NodeProto, spatial: int, kernel_shape: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Conv's or ConvTranspose's weight (1-D kernels as 2-D ones of height 1), checked against the input's rank
    and ``kernel_shape`` if given, and its bias, if any."""
    weight = ctx.weight(node.input[1], f"{node.op_type} weight")
    if weight.dim() != spatial + 2:
        raise OnnxLoadError(f"{node.op_type} weight {list(weight.shape)} does not match a {spatial}-D input")
    if kernel_shape is not None and list(kernel_shape) != list(weight.shape[2:]):
        raise OnnxLoadError(f"kernel_shape {kernel_shape} does not match the weight {list(weight.shape)}")
    bias_name = input_name(node, 2)
    bias = ctx.weight(bias_name, f"{node.op_type} bias") if bias_name else None
    return (weight.unsqueeze(2) if spatial == 1 else weight), bias


def _conv(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = spatial_rank(ctx, node)
    weight, bias = _kernel(ctx, node, spatial, attrs.get("kernel_shape"))
    stride, dilation = two_d(attrs, "strides", 1, spatial), two_d(attrs, "dilations", 1, spatial)
    pads = onnx_pads(attrs, spatial)
    group = attrs.get("group", 1)
    emit_spatial(ctx, node, lambda shape: Conv2d(weight, bias, shape, stride, pads, dilation, group))


def _conv_transpose(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    spatial = spatial_rank(ctx, node)
    if "output_shape" in attrs:
        raise UnsupportedModelError("ConvTranspose with output_shape (give pads and output_padding instead)")
    weight, bias = _kernel(ctx, node, spatial)
    stride, dilation = two_d(attrs, "strides", 1, spatial), two_d(attrs, "dilations", 1, spatial)
    output_padding = two_d(attrs, "output_padding", 0, spatial)
    pads = onnx_pads(attrs, spatial)
    group = attrs.get("group", 1)
    emit_spatial(ctx, node, lambda shape: ConvTranspose2d(weight, bias, stride, pads, output_padding, dilation, group))


def _batch_norm(ctx: LoadContext, node: onnx.NodeProto, attrs: dict) -> None:
    if attrs.get("training_mode", 0) or any(node.output[1:]):
        raise OnnxLoadError("BatchNormalization in training mode; export the model in eval mode")
    gamma, beta, mean, var = (
        ctx.weight(name, f"BatchNormalization {role}")
        for name, role in zip(node.input[1:], ("scale", "bias", "mean", "var"), strict=True)
    )
    epsilon = attrs.get("epsilon", 1e-5)
    emit_per_sample(ctx, node, lambda shape: BatchNorm(gamma, beta, mean, var, epsilon, shape))


LINEAR_CONVERTERS: dict[str, Converter] = {
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "BatchNormalization": _batch_norm,
}
