"""Muon, AdamW8bit and their pieces in one process, against torch.optim and exact arithmetic."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_fedshard.models import Llama, LlamaConfig
from lightning_fedshard.optim import (
    AdamW8bit,
    Muon,
    assign_owners,
    muon_param_groups,
    newton_schulz,
)


def test_newton_schulz_in_bf16_is_torch_optim_muons_bit_for_bit():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    for matrix in (g, g.T):
        ours = newton_schulz(matrix, dtype=torch.bfloat16)
        assert torch.equal(ours, _zeropower_via_newtonschulz(matrix, (3.4445, -4.7750, 2.0315), 5, 1e-7).float())


def test_newton_schulz_in_fp32_brings_singular_values_near_one():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert newton_schulz(g).dtype == torch.float32
    assert 0.6 < s.min() and s.max() < 1.25  # the quintic's band, not exactly 1


def test_muon_on_plain_tensors_is_torch_optim_muon_and_adamw():
    gen = torch.Generator().manual_seed(2)
    ours = [nn.Parameter(torch.randn(16, 8, generator=gen)), nn.Parameter(torch.randn(8, 24, generator=gen))]
    vector = nn.Parameter(torch.randn(8, generator=gen))
    refs = [nn.Parameter(p.detach().clone()) for p in ours]
    ref_vector = nn.Parameter(vector.detach().clone())
    opt = Muon(
        [{"params": ours, "use_muon": True}, {"params": [vector], "use_muon": False}],
        lr=0.02,
        weight_decay=0.1,
        adamw_lr=0.01,
        adamw_betas=(0.9, 0.95),
        adamw_weight_decay=0.05,
        ns_dtype=torch.bfloat16,
    )
    ref = torch.optim.Muon(refs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([ref_vector], lr=0.01, betas=(0.9, 0.95), weight_decay=0.05, foreach=False)
    for _ in range(3):
        for p, r in zip([*ours, vector], [*refs, ref_vector]):
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        opt.step(), ref.step(), ref_adamw.step()
        assert all(torch.equal(p, r) for p, r in zip(ours, refs))
        assert torch.equal(vector, ref_vector)
        assert opt.orthogonalised == [0, 1]


def test_muon_routes_embeddings_head_and_norms_to_adamw():
    model = Llama(LlamaConfig.from_name("llama3.1-micro"))
    groups = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in groups[0]["params"]}
    assert muon_names == {n for n, _ in model.named_parameters() if n.startswith("layers.") and "norm" not in n}
    assert {names[id(p)] for p in groups[1]["params"]} == {"tok_embeddings.weight", "output.weight"}
    assert groups[2]["weight_decay"] == 0.0 and all(p.ndim == 1 for p in groups[2]["params"])
    # a group without `use_muon` is split by shape
    opt = Muon(model.parameters())
    assert {len(g["params"]) for g in opt.param_groups if g["use_muon"]} == {2 + 7 * 2}


def test_muon_rejects_bad_arguments():
    w = [nn.Parameter(torch.zeros(3, 3))]
    for kwargs, word in [
        ({"momentum": 1.0}, "momentum"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"adjust_lr": "x"}, "adjust_lr"),
    ]:
        with pytest.raises(ValueError, match=word):
            Muon(w, **kwargs)
    with pytest.raises(ValueError, match="not matrices"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])


def test_owners_balance_greedily_and_deterministically():
    costs = [9, 4, 4, 1, 7, 7]
    owners = assign_owners(costs, 3)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert owners == assign_owners(costs, 3) and sorted(loads) == [10, 11, 11]
    assert max(loads) <= 4 / 3 * math.ceil(sum(costs) / 3)


def test_adamw8bit_tracks_fp32_adamw_on_a_regression_with_a_quarter_of_the_state():
    def train(make):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 1))
        x = torch.randn(128, 16)
        y = torch.sin(x[:, :1] * 2)
        opt = make(net.parameters())
        first = nn.functional.mse_loss(net(x), y).item()
        for _ in range(40):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.ndim)
        return loss.item(), state, first

    kwargs = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
    fp32_loss, fp32_bytes, first = train(lambda p: torch.optim.AdamW(p, **kwargs))
    q_loss, q_bytes, _ = train(lambda p: AdamW8bit(p, block_size=128, min_8bit_numel=0, **kwargs))
    assert fp32_loss < 0.5 * first  # it learns, so tracking it means something
    assert q_loss < 1.15 * fp32_loss + 1e-3, (q_loss, fp32_loss)
    assert q_bytes / fp32_bytes == pytest.approx((2 + 8 / 128) / 8, rel=0.05)


def test_adamw8bit_resumes_from_its_state_dict_with_8bit_states_and_the_same_steps():
    # torch.optim.Optimizer.load_state_dict casts floating parameters' states to the parameter's dtype; the codes
    # must come back as int8/uint8 (a resumed run would otherwise hold fp32 moments, 4x the memory).
    def net_and_opt():
        torch.manual_seed(0)
        net = nn.Linear(64, 64)
        return net, AdamW8bit(net.parameters(), lr=1e-2, block_size=32, min_8bit_numel=0)

    def step(net, opt, i):
        torch.manual_seed(100 + i)
        net.weight.grad, net.bias.grad = torch.randn_like(net.weight), torch.randn_like(net.bias)
        opt.step()

    net, opt = net_and_opt()
    for i in range(2):
        step(net, opt, i)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    for i in range(2, 4):
        step(net, opt, i)
    fresh, fresh_opt = net_and_opt()
    fresh.load_state_dict(saved[0])
    fresh_opt.load_state_dict(saved[1])
    dtypes = {(k, str(v.dtype)) for state in fresh_opt.state.values() for k, v in state.items() if k != "step"}
    assert dtypes == {
        ("exp_avg", "torch.int8"),
        ("exp_avg_sq", "torch.uint8"),
        ("exp_avg_scale", "torch.float32"),
        ("exp_avg_sq_scale", "torch.float32"),
    }
    for i in range(2, 4):
        step(fresh, fresh_opt, i)
    assert torch.equal(fresh.weight, net.weight) and torch.equal(fresh.bias, net.bias)


def test_adamw8bit_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        AdamW8bit([nn.Parameter(torch.zeros(3))], block_size=100)
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit([nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
