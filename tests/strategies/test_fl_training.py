"""FL+FSDP / FL+HSDP training on real gloo processes, checked against single-process references."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from tests.strategies.conftest import share_launch
from tests.strategies.worker import make_dataset, make_optimizer, random_model

pytestmark = pytest.mark.multiproc

AUTO_WRAP = ["__main__.Block"]
LR = 0.05
BATCH = 4


def fl_fsdp(**kwargs) -> dict:
    return {"num_groups": 2, "auto_wrap": AUTO_WRAP, **kwargs}


FL_FSDP = {
    "strategy": "fl_fsdp",
    "strategy_kwargs": fl_fsdp(sync_every=3),
    "devices": 4,
    "max_steps": 7,
    "lr": LR,
    "batch_size": BATCH,
    "limit_val_batches": 2,
    "val_check_interval": 4,  # a no-grad forward before the sync at step 6 leaves the root units unsharded
}
FL_FSDP_EVERY_STEP = {**FL_FSDP, "strategy_kwargs": fl_fsdp(sync_every=1), "max_steps": 6, "limit_val_batches": 0}
FL_HSDP = {
    "strategy": "fl_hsdp",
    "strategy_kwargs": {"num_groups": 2, "replicate_size": 2, "shard_size": 2, "sync_every": 2, "auto_wrap": AUTO_WRAP},
    "devices": 8,
    "max_steps": 4,
    "lr": LR,
    "batch_size": BATCH,
}
FL_HSDP_LEADER_DILOCO = {
    **FL_HSDP,
    "strategy_kwargs": {
        "num_groups": 2,
        "replicate_size": 2,
        "shard_size": 2,
        "sync_every": 2,
        "sync_mode": "leader",
        "outer_optimizer": "nesterov",
    },
    "shard_in_configure_model": True,  # fully_shard(..., mesh=self.device_mesh): the group's HSDP mesh
}
# bf16 parameters, fp32 average; two micro-batches per optimizer step
FL_FSDP_BF16_ACCUMULATE = {
    **FL_FSDP,
    "strategy_kwargs": fl_fsdp(sync_every=2, sync_dtype="float32"),
    "max_steps": 4,
    "accumulate": 2,
    "precision": "bf16-true",
    "limit_val_batches": 0,
}
FSDP2 = {
    "strategy": "fsdp2",
    "strategy_kwargs": {"auto_wrap": AUTO_WRAP},
    "devices": 4,
    "max_steps": 5,
    "lr": LR,
    "batch_size": BATCH,
    "limit_val_batches": 2,
    "val_check_interval": 5,  # fit ends with a no-grad forward, then trainer.validate sets up again
    "validate_after_fit": True,
}
HSDP = {**FSDP2, "strategy": "hsdp", "strategy_kwargs": {"shard_size": 2, "auto_wrap": AUTO_WRAP}}
# the structure-aware optimizers (lightning_fedshard.optim) from configure_optimizers, one group
MUON_HSDP = {**HSDP, "optimizer": "muon", "limit_val_batches": 0}
ADAMW8BIT_FSDP2 = {**FSDP2, "optimizer": "adamw8bit", "limit_val_batches": 0}
share_launch(
    FL_FSDP, FL_FSDP_EVERY_STEP, FL_FSDP_BF16_ACCUMULATE, FSDP2, HSDP, MUON_HSDP, ADAMW8BIT_FSDP2, FL_HSDP,
    FL_HSDP_LEADER_DILOCO,
)  # fmt: skip


# ---- independent references ---------------------------------------------------------------------


def rank_batch(rank: int, step: int, world: int) -> list[int]:
    """Dataset indices of ``rank``'s batch at ``step`` (first epoch): Lightning shuffles training data with a
    DistributedSampler seeded 0 over the ``distributed_sampler_kwargs`` the strategy gives it."""
    sampler = DistributedSampler(make_dataset(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    return list(sampler)[step * BATCH : (step + 1) * BATCH]


def initial_model(state: dict[str, torch.Tensor]) -> nn.Module:
    model = random_model()
    model.load_state_dict({name.removeprefix("net."): t for name, t in state.items()})
    return model


def sgd_step(model: nn.Module, indices: list[int]) -> None:
    x, y = make_dataset()[indices]
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad


def named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"net.{name}": p.detach().clone() for name, p in model.named_parameters()}


def assert_params_close(actual: dict, expected: dict, **tol) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


def mean_params(states: list[dict]) -> dict[str, torch.Tensor]:
    return {name: sum(s[name] for s in states) / len(states) for name in states[0]}


def differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


# ---- layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "mesh", "fsdp_dims", "fed_group_of_rank0"),
    [
        (FL_FSDP, [[[0, 1]], [[2, 3]]], ("shard",), [0, 2]),
        (FL_HSDP, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ("replicate", "shard"), [0, 4]),
        (FSDP2, [[[0, 1, 2, 3]]], ("shard",), [0]),
        (HSDP, [[[0, 1], [2, 3]]], ("replicate", "shard"), [0]),
    ],
    ids=["fl_fsdp-2x1x2", "fl_hsdp-2x2x2", "fsdp2", "hsdp"],
)
def test_mesh_shape_and_rank_layout(run_worker, cfg, mesh, fsdp_dims, fed_group_of_rank0):
    ranks = run_worker(cfg)
    world = cfg["devices"]
    for rank, record in enumerate(ranks):
        assert record["mesh"] == mesh and record["mesh_dim_names"] == ("fed", "replicate", "shard")
        assert record["fsdp_mesh_dims"] == fsdp_dims
        assert record["sampler"] == {"num_replicas": world, "rank": rank}
    assert ranks[0]["fed_group_ranks"] == fed_group_of_rank0


# ---- federated rounds -----------------------------------------------------------------------------


def test_groups_start_identical_diverge_between_syncs_and_agree_after(run_worker):
    ranks = run_worker(FL_FSDP)
    for record in ranks[1:]:  # every rank drew different random weights; the strategy broadcast rank 0's
        assert not differ(record["initial"], ranks[0]["initial"])
    group0, group1 = ranks[0], ranks[2]
    for step, (p0, p1) in enumerate(zip(group0["params"], group1["params"], strict=True), start=1):
        assert differ(p0, p1) == (step % 3 != 0), f"step {step}"
    assert [s["step"] for s in group0["syncs"]] == [3, 6, 7]  # 7: the closing sync of fit
    assert group0["syncs_count"] == 3


def test_sync_sets_every_rank_to_the_exact_mean_of_the_groups(run_worker):
    for cfg in (FL_FSDP, FL_HSDP):
        ranks = run_worker(cfg)
        group_size = len(ranks) // 2
        for k in range(len(ranks[0]["syncs"])):
            pre = [ranks[0]["syncs"][k]["pre"], ranks[group_size]["syncs"][k]["pre"]]
            assert differ(*pre)
            expected = mean_params(pre)
            for record in ranks:
                assert_params_close(record["syncs"][k]["post"], expected, rtol=1e-6, atol=1e-7)


def test_hsdp_replicas_stay_identical_inside_a_group(run_worker):
    ranks = run_worker(FL_HSDP)
    for step in range(FL_HSDP["max_steps"]):
        assert not differ(ranks[0]["params"][step], ranks[2]["params"][step])  # replica 0 vs 1 of group 0
        assert not differ(ranks[4]["params"][step], ranks[6]["params"][step])


@pytest.mark.parametrize("cfg", [FSDP2, HSDP], ids=["fsdp2", "hsdp"])
def test_one_group_equals_a_single_process_sgd_reference(run_worker, cfg):
    ranks = run_worker(cfg)
    world = cfg["devices"]
    reference = initial_model(ranks[0]["initial"])
    for step in range(cfg["max_steps"]):
        sgd_step(reference, [i for r in range(world) for i in rank_batch(r, step, world)])
        for record in ranks:
            assert_params_close(record["params"][step], named(reference), rtol=1e-5, atol=1e-6)
    assert all(record["syncs_count"] == 0 for record in ranks)
    if cfg.get("validate_after_fit"):
        # two validation batches of 64 per rank, distinct across ranks, averaged over the world
        x, y = make_dataset()[list(range(world * 2 * 64))]
        expected = nn.functional.mse_loss(reference(x), y).item()
        assert ranks[0]["validated"][0]["val_loss"] == pytest.approx(expected, rel=1e-5)


# Muon: the same Newton–Schulz on the owner's gathered matrix, so float rounding only; AdamW8bit: the same blocks, but
# a gradient one rounding away can move a code by one step (lr · scale/127 / √v ≈ 4e-4 here)
@pytest.mark.parametrize(("cfg", "atol"), [(MUON_HSDP, 1e-6), (ADAMW8BIT_FSDP2, 1e-3)], ids=["muon-hsdp", "adamw8bit-fsdp2"])
def test_muon_and_adamw8bit_in_one_group_equal_a_single_process_run(run_worker, cfg, atol):
    ranks = run_worker(cfg)
    world = cfg["devices"]
    reference = initial_model(ranks[0]["initial"])
    optimizer = make_optimizer(cfg["optimizer"], reference, LR)
    for step in range(cfg["max_steps"]):
        x, y = make_dataset()[[i for r in range(world) for i in rank_batch(r, step, world)]]
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        for record in ranks:
            assert_params_close(record["params"][step], named(reference), rtol=1e-5, atol=atol)
    assert differ(ranks[0]["params"][-1], ranks[0]["initial"])


def test_sync_every_step_equals_the_average_of_the_groups_models(run_worker):
    ranks = run_worker(FL_FSDP_EVERY_STEP)
    world, groups = 4, [[0, 1], [2, 3]]
    consensus = ranks[0]["initial"]
    for step in range(FL_FSDP_EVERY_STEP["max_steps"]):
        models = []
        for group in groups:  # each group takes one SGD step on its own ranks' batches
            model = initial_model(consensus)
            sgd_step(model, [i for r in group for i in rank_batch(r, step, world)])
            models.append(named(model))
        consensus = mean_params(models)
        for record in ranks:
            assert_params_close(record["params"][step], consensus, rtol=1e-5, atol=1e-6)


def test_nesterov_outer_step_matches_a_hand_written_diloco_update(run_worker):
    ranks = run_worker(FL_HSDP_LEADER_DILOCO)
    outer_lr, momentum = 0.7, 0.9
    global_params = dict(ranks[0]["initial"])
    buffers = {name: torch.zeros_like(t) for name, t in global_params.items()}
    for k in range(len(ranks[0]["syncs"])):
        local = mean_params([ranks[0]["syncs"][k]["pre"], ranks[4]["syncs"][k]["pre"]])
        for name in global_params:
            pseudo_grad = global_params[name] - local[name]
            buffers[name] = momentum * buffers[name] + pseudo_grad
            global_params[name] = global_params[name] - outer_lr * (pseudo_grad + momentum * buffers[name])
        for record in ranks:
            assert_params_close(record["syncs"][k]["post"], global_params, rtol=1e-5, atol=1e-6)


def test_accumulation_window_is_one_step_and_bf16_shards_are_averaged_in_fp32(run_worker):
    ranks = run_worker(FL_FSDP_BF16_ACCUMULATE)
    for record in ranks:
        assert len(record["losses"]) == 8 and record["optimizer_steps"] == 4
        assert [s["step"] for s in record["syncs"]] == [2, 4]
    for k in range(2):
        pre = [ranks[0]["syncs"][k]["pre"], ranks[2]["syncs"][k]["pre"]]
        assert all(t.dtype == torch.bfloat16 for t in pre[0].values())
        fp32_mean = {n: ((pre[0][n].float() + pre[1][n].float()) / 2).to(torch.bfloat16) for n in pre[0]}
        for record in ranks:
            assert all(torch.equal(record["syncs"][k]["post"][n], fp32_mean[n]) for n in fp32_mean)
    # the all-reduce carries fp32: twice the bf16 parameter bytes across the ranks of a group
    fed = sum(ranks[r]["ledger_steps"][3]["comm/fed_bytes"] for r in (0, 1))  # batch 4 closes optimizer step 2
    assert fed == 2 * param_bytes(ranks[0])


# ---- communication ledger -------------------------------------------------------------------------


def param_bytes(record: dict) -> int:
    return sum(t.numel() * t.element_size() for t in record["initial"].values())


def fed_bytes(record: dict, step: int) -> float:
    return record["ledger_steps"][step - 1]["comm/fed_bytes"]


def test_fed_bytes_per_step_fall_by_sync_every_and_match_parameter_bytes_over_shard_size(run_worker):
    every_3 = run_worker(FL_FSDP)
    every_1 = run_worker(FL_FSDP_EVERY_STEP)
    # Each rank all-reduces its 1/S slice; with F = 2 the ring sends 2·(F-1)/F = 1× that slice, so the
    # ranks of one group together send the model's bytes once per sync.
    for records, sync_every in ((every_3, 3), (every_1, 1)):
        for step in range(sync_every, len(records[0]["ledger_steps"]) + 1, sync_every):
            assert fed_bytes(records[0], step) + fed_bytes(records[1], step) == param_bytes(records[0])
    for record in every_3:
        assert [fed_bytes(record, s) > 0 for s in range(1, 7)] == [False, False, True, False, False, True]
    mean_3 = sum(fed_bytes(every_3[0], s) for s in range(1, 7)) / 6
    mean_1 = sum(fed_bytes(every_1[0], s) for s in range(1, 7)) / 6
    assert mean_1 == pytest.approx(3 * mean_3)
    assert all(
        step["comm/shard_bytes"] > 0 and step["comm/replicate_bytes"] == 0 for step in every_3[0]["ledger_steps"]
    )


def test_hsdp_ledger_counts_the_replicate_tier_and_leader_mode_halves_fed_traffic(run_worker):
    every_replica = run_worker(FL_HSDP)
    leader = run_worker(FL_HSDP_LEADER_DILOCO)
    group0 = range(4)  # ranks (replicate, shard) = (0,0), (0,1), (1,0), (1,1)
    model_bytes = param_bytes(every_replica[0])
    assert sum(fed_bytes(every_replica[r], 2) for r in group0) == 2 * model_bytes
    assert sum(fed_bytes(leader[r], 2) for r in group0) == model_bytes
    assert [fed_bytes(leader[r], 2) > 0 for r in group0] == [True, True, False, False]
    for record in every_replica:
        assert all(step["comm/replicate_bytes"] > 0 for step in record["ledger_steps"])
        assert all(step["fed/syncs"] == (i + 1) // 2 for i, step in enumerate(record["ledger_steps"]))
