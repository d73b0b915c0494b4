"""The Llama model on a GPU in bf16 against the same weights in fp32 on the CPU: forward and backward under bf16
autocast (what ``bf16-mixed`` runs) and with bf16 weights (``bf16-true``). Marked ``cuda``: ``pytest -m cuda`` runs
them (``make gpu-check``); they skip without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from lightning_fedshard.models import Llama, LlamaConfig

pytestmark = pytest.mark.cuda


def _model_and_batch() -> tuple[Llama, torch.Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig.from_name("llama3.1-tiny")
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(1))
    return Llama(config), tokens


def _loss_and_grads(model: Llama, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("mode", ["autocast", "bf16 weights"])
def test_bf16_forward_backward_on_cuda_follow_fp32_on_cpu(mode: str) -> None:
    reference, tokens = _model_and_batch()
    model = copy.deepcopy(reference).cuda()
    expected_loss, expected_grads = _loss_and_grads(reference, tokens)
    if mode == "autocast":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, grads = _loss_and_grads(model, tokens.cuda())
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    else:
        loss, grads = _loss_and_grads(model.to(torch.bfloat16), tokens.cuda())
    # bf16 keeps 8 bits of mantissa: the loss to ~1 %, every gradient pointing the same way
    torch.testing.assert_close(loss, expected_loss, rtol=2e-2, atol=0.0)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert _cosine(grad, expected_grads[name]) > 0.98, name


def test_bf16_autocast_runs_the_matrix_products_in_bf16() -> None:
    model, tokens = _model_and_batch()
    model = model.cuda()
    seen = []
    first = next(m for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(tokens[:, :-1].cuda())
    assert seen == [torch.bfloat16]
