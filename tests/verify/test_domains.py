"""Branch-and-bound domain storage: the pool hands out exactly the worst domains and keeps every field of every
other domain together, across growth and refills; splits clamp the right neuron of the right child."""

import torch

from lightning_fedshard.verify.bab.domains import DomainBatch, DomainPool


def _domains(ids: torch.Tensor, rows: int = 2, width: int = 3) -> DomainBatch:
    """Domains whose every field carries its id, so that a mix-up between fields shows."""
    n = len(ids)
    tag = ids.float()
    return DomainBatch(
        lower={"z": tag.view(n, 1).expand(n, width).clone() - 10},
        upper={"z": tag.view(n, 1).expand(n, width).clone() + 10},
        splits={"z": torch.zeros(n, width, dtype=torch.int8)},
        points={"z": torch.zeros(n, width)},
        betas={"z": tag.view(1, n, 1).expand(rows, n, width).clone()},
        alphas={"relu": -tag.view(1, n, 1).expand(rows, n, width).clone()},
        margins=torch.stack([tag, tag + 0.5], 1),
        depth=ids.clone(),
        branch_layer=torch.zeros(n, dtype=torch.long),
        branch_neuron=ids % width,
        branch_point=torch.zeros(n),
    )


def _consistent(batch: DomainBatch) -> torch.Tensor:
    ids = batch.depth
    tag = ids.float()
    assert torch.equal(batch.lower["z"][:, 0], tag - 10) and torch.equal(batch.upper["z"][:, 2], tag + 10)
    assert torch.equal(batch.betas["z"][1, :, 0], tag) and torch.equal(batch.alphas["relu"][0, :, 1], -tag)
    assert torch.equal(batch.margins[:, 0], tag) and torch.equal(batch.branch_neuron, ids % 3)
    return ids


def _lowest(margins: torch.Tensor) -> torch.Tensor:
    return margins.min(1).values


def test_pool_pops_the_worst_and_keeps_the_rest_intact():
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    pool = DomainPool(_domains(order[:1]))
    for chunk in order[1:].split(7):  # many pushes: the storage grows by doubling
        pool.push(_domains(chunk))
    assert len(pool) == 100
    popped = []
    for size in (10, 1, 25, 30):
        batch = pool.pop_worst(size, _lowest)
        ids = _consistent(batch)
        remaining = _consistent(pool.view())
        assert ids.numel() == size and remaining.numel() == len(pool)
        assert ids.max() < remaining.min()  # exactly the lowest values left the pool
        popped += ids.tolist()
        pool.push(_domains(ids[: size // 2] + 1000))  # refill while popping
    everything = set(_consistent(pool.view()).tolist()) | set(popped)
    assert set(range(100)) <= everything


def test_pop_worst_more_than_the_pool_holds_empties_it():
    pool = DomainPool(_domains(torch.arange(3)))
    assert len(pool.pop_worst(10, lambda m: m[:, 0])) == 3 and len(pool) == 0


def test_split_clamps_the_chosen_neuron_in_each_child():
    parents = _domains(torch.tensor([4, 7]))
    children = parents.split(["z"], torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([0.0, 2.5]))
    assert len(children) == 4 and children.depth.tolist() == [5, 8, 5, 8]
    lower, upper, splits = children.lower["z"], children.upper["z"], children.splits["z"]
    assert lower[0, 1] == 0 and upper[2, 1] == 0 and lower[1, 2] == 2.5 and upper[3, 2] == 2.5
    assert splits.tolist() == [[0, 1, 0], [0, 0, 1], [0, -1, 0], [0, 0, -1]]
    assert children.points["z"].tolist() == [[0, 0, 0], [0, 0, 2.5], [0, 0, 0], [0, 0, 2.5]]
    assert lower[0, 0] == parents.lower["z"][0, 0] and upper[0, 1] == parents.upper["z"][0, 1]
