"""Muon for weight matrices, AdamW for everything else, on plain tensors and on FSDP2's sharded DTensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from lightning_fedshard.optim.newton_schulz import newton_schulz
from lightning_fedshard.optim.owner_exchange import ShardLayout, local_shard, transform_on_owners
from lightning_fedshard.optim.owners import assign_owners, ns_cost

__all__ = ["Muon", "muon_param_groups"]

ADJUST_LR = ("match_rms_adamw", "original")


def muon_param_groups(module: nn.Module, head_names: Sequence[str] = ("output", "lm_head")) -> list[dict[str, Any]]:
    """Parameter groups that give Muon the hidden weight matrices and AdamW the rest.

    A *matrix* is the weight of an ``nn.Linear`` whose name is not in ``head_names`` (the output projection, whose
    rows are per-token, like an embedding's; torchtitan and Moonshot keep both on AdamW). Embeddings, norms, biases
    and any other parameter go to AdamW; 1-D ones without weight decay. Example::

        optimizer = Muon(muon_param_groups(model), lr=3e-3, weight_decay=0.1)
    """
    matrices = {
        id(m.weight)
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in head_names
    }
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) in matrices], "use_muon": True},
        {"params": [p for p in params if id(p) not in matrices and p.ndim >= 2], "use_muon": False},
        {"params": [p for p in params if id(p) not in matrices and p.ndim < 2], "use_muon": False, "weight_decay": 0.0},
    ]


class Muon(Optimizer):
    """Muon (momentum orthogonalised by Newton–Schulz) for 2-D matrices, AdamW for the other parameters.

    A group's ``use_muon`` key says which it gets; a group without it is split: 2-D parameters to Muon, the rest to
    AdamW (use :func:`muon_param_groups` to keep embeddings and the output head on AdamW, as torchtitan does).

    Muon, per matrix ``W`` (``m × n``) with gradient ``G`` (``torch.optim.Muon``'s update): ``B ← μB + (1-μ)G``;
    ``U = (1-μ)G + μB`` (Nesterov) or ``B``; ``O = NS₅(U)``; ``W ← W(1 - lr·λ) - lr·s·O``, with the shape scale
    ``s = 0.2·√max(m, n)`` (``adjust_lr="match_rms_adamw"``, Moonshot's: the update's RMS matches AdamW's, so
    AdamW's learning rate and weight decay carry over) or ``√max(1, m/n)`` (``"original"``, Keller Jordan's).
    Newton–Schulz runs in bf16 on accelerators and fp32 on CPU (:func:`~lightning_fedshard.optim.ns_dtype`), or in
    ``ns_dtype`` when given (``torch.bfloat16`` everywhere is ``torch.optim.Muon``'s choice).

    Under FSDP2 the matrices are ``Shard(d)`` DTensors. Each matrix gets an owner rank in its shard group (greedy
    by Newton–Schulz cost, :func:`~lightning_fedshard.optim.assign_owners`); one ``all_to_all`` gathers every
    matrix's momentum-updated shards on its owner, each owner orthogonalises its matrices, and a second
    ``all_to_all`` returns the shards. Every matrix is orthogonalised exactly once per step in each shard group
    (HSDP replicas each do their own); :attr:`orthogonalised` lists the indices this rank did in the last step.

    AdamW groups take ``lr=adamw_lr`` (default: ``lr``), ``betas``, ``eps`` and ``weight_decay=adamw_weight_decay``
    unless the group sets them, and run ``torch.optim.adamw``'s functional step on the local shards.

    Example::

        optimizer = Muon(muon_param_groups(model), lr=3e-3, momentum=0.95, weight_decay=0.1, adamw_lr=3e-3)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.1,
        adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw",
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.1,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        if not 0.0 <= lr < math.inf or (adamw_lr is not None and not 0.0 <= adamw_lr < math.inf):
            raise ValueError(f"Muon: learning rates must be finite and ≥ 0, got lr={lr}, adamw_lr={adamw_lr}.")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: `momentum` must be in [0, 1), got {momentum}.")
        if not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
            raise ValueError(f"Muon: `ns_steps` must be an integer in [1, 100), got {ns_steps!r}.")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Muon: unknown `adjust_lr={adjust_lr!r}`; choose one of {ADJUST_LR}.")
        if not all(0.0 <= b < 1.0 for b in adamw_betas):
            raise ValueError(f"Muon: `adamw_betas` must be in [0, 1), got {adamw_betas}.")
        adamw_defaults = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        groups = []
        for group in _as_groups(params):
            if "use_muon" in group:
                groups.append(group)
                continue
            rest = {k: v for k, v in group.items() if k != "params"}
            groups.append({**rest, "params": [p for p in group["params"] if p.ndim == 2], "use_muon": True})
            groups.append({**rest, "params": [p for p in group["params"] if p.ndim != 2], "use_muon": False})
        for group in groups:
            if not group["use_muon"]:
                for key, value in adamw_defaults.items():
                    group.setdefault(key, value)
            elif bad := [tuple(p.shape) for p in group["params"] if p.ndim != 2]:
                raise ValueError(f"Muon: a `use_muon` group holds parameters that are not matrices: shapes {bad}.")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "weight_decay": weight_decay,
            "adjust_lr": adjust_lr,
            "ns_dtype": ns_dtype,
        }
        super().__init__([g for g in groups if g["params"]], defaults)
        self.orthogonalised: list[int] = []
        """Indices (in the order of every Muon matrix of every group) this rank orthogonalised in the last step."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        return loss

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        entries = []  # (param, group, update shard, layout)
        for group in groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad, buf = local_shard(p.grad), local_shard(state["momentum_buffer"])
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf.clone()
                entries.append((p, group, update, ShardLayout.of(p)))
        self.orthogonalised = []
        buckets: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, (_, _, update, layout) in enumerate(entries):
            buckets.setdefault((id(layout.group), update.dtype), []).append(i)
        for members in buckets.values():
            layouts = [entries[i][3] for i in members]
            owners = assign_owners([ns_cost(layout.shape) for layout in layouts], layouts[0].world)
            done = transform_on_owners(
                [entries[i][2] for i in members],
                layouts,
                owners,
                lambda j, whole: newton_schulz(whole, entries[members[j]][1]["ns_steps"], entries[members[j]][1]["ns_dtype"]),
            )
            self.orthogonalised += [members[j] for j in done]
        self.orthogonalised.sort()
        for p, group, update, layout in entries:
            local = local_shard(p)
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(update, alpha=-group["lr"] * _shape_scale(layout.shape, group["adjust_lr"]))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(local_shard(p))
            grads.append(local_shard(p.grad))
            exp_avgs.append(local_shard(state["exp_avg"]))
            exp_avg_sqs.append(local_shard(state["exp_avg_sq"]))
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _shape_scale(shape: tuple[int, ...], adjust_lr: str) -> float:
    rows, cols = shape
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))


def _as_groups(params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    items = list(params)
    if not items:
        raise ValueError("Muon got an empty parameter list.")
    return [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
