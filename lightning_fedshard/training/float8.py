"""Float8 training of the Llama blocks' linear layers through torchao (``LlamaPretraining(float8=True)``).

torchao's :func:`~torchao.float8.convert_to_float8_training` swaps ``nn.Linear`` modules for ``Float8Linear``, whose
matrix products cast their inputs, weights and output gradients to float8 with a dynamic per-tensor scale (the
weights stay in their own dtype: the optimizer and the FSDP2 shards do not change). As torchtitan does, only the
linear layers inside the transformer blocks are converted, never the embedding or the output head (whose logits
feed the loss), and only those whose both dimensions are multiples of 16 (float8 matrix products need them). The
conversion runs on the meta model, before the strategy shards it; each converted layer keeps its own
initialisation. Float8 tensor cores need an NVIDIA GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell),
and the casts are fast only when compiled (``compile=[TransformerBlock]`` on the strategy); on the CPU torch's float8
matrix product runs too (for tests). Example::

    check_float8_available()  # before any process starts: torchao installed?
    check_float8_device(torch.device("cuda", 0))
    converted = convert_blocks_to_float8(model)  # ['layers.0.attention.wq', ...]
"""

from __future__ import annotations

import importlib.util
import types

import torch
from torch import nn

from lightning_fedshard.models.llama import TransformerBlock

__all__ = ["FLOAT8_MIN_CAPABILITY", "check_float8_available", "check_float8_device", "convert_blocks_to_float8"]

#: float8 (e4m3/e5m2) tensor-core matrix products: sm89 (Ada) and later.
FLOAT8_MIN_CAPABILITY = (8, 9)


def check_float8_available() -> None:
    """Raises :class:`ImportError` unless torchao is installed."""
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
            "float8=True trains the blocks' linear layers in float8 through torchao, which is not installed: "
            "pip install 'lightning-fedshard[float8]' (or float8=False)."
        )


def check_float8_device(device: torch.device) -> None:
    """Raises :class:`ValueError` unless ``device`` is a CUDA GPU of compute capability 8.9 or more, or the CPU
    (torch's float8 matrix product there is for tests: correct, slower than bf16)."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(
            f"float8=True needs an NVIDIA GPU of compute capability ≥ 8.9 (Ada, Hopper or later) or the CPU; this run"
            f" trains on {device.type!r}. Train with float8=False here."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"float8=True needs an NVIDIA GPU of compute capability ≥ 8.9 (Ada, Hopper or later) for float8 matrix"
            f" products; {name} is sm{capability[0]}{capability[1]}. Train with float8=False on it."
        )


def float8_targets(model: nn.Module) -> list[str]:
    """The qualified names of the linear layers :func:`convert_blocks_to_float8` converts: those inside a
    :class:`~lightning_fedshard.models.llama.TransformerBlock` whose both dimensions are multiples of 16."""
    return [
        f"{block_name}.{name}"
        for block_name, block in model.named_modules()
        if isinstance(block, TransformerBlock)
        for name, linear in block.named_modules()
        if isinstance(linear, nn.Linear) and linear.in_features % 16 == 0 and linear.out_features % 16 == 0
    ]


def convert_blocks_to_float8(model: nn.Module) -> list[str]:
    """Converts the blocks' linear layers of ``model`` (:func:`float8_targets`) to torchao's ``Float8Linear`` in
    place, before sharding; returns their names. Each keeps its own ``reset_parameters()``, so a meta model is
    initialised as it would be unconverted."""
    check_float8_available()
    from torchao.float8 import convert_to_float8_training

    targets = set(float8_targets(model))
    if not targets:
        raise ValueError(
            f"float8=True: no linear layer of {type(model).__name__}'s blocks has both dimensions divisible by 16;"
            " float8 matrix products need them."
        )
    originals = {name: model.get_submodule(name) for name in targets}
    convert_to_float8_training(model, module_filter_fn=lambda _, name: name in targets)
    for name, original in originals.items():
        std = getattr(original, "init_std", None)
        if std is not None:  # the blocks' own truncated normal of σ = init_std, not nn.Linear's default
            converted = model.get_submodule(name)
            converted.init_std = std
            converted.reset_parameters = types.MethodType(type(original).reset_parameters, converted)
    return sorted(targets)
