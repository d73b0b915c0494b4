import pytest

from lightning_fedshard.strategies.ledger import CommLedger, ring_bytes


def test_ring_bytes_follow_the_ring_algorithms():
    assert ring_bytes("all_gather", 1000, 4) == 750
    assert ring_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("broadcast", 1000, 2) == 500
    assert ring_bytes("all_reduce", 1000, 1) == 0


def test_ledger_closes_steps_and_averages_them():
    ledger = CommLedger()
    ledger.record("fed", "all_reduce", 400, 2)
    ledger.record("shard", "all_gather", 100, 2)
    assert ledger.close_step() == {"shard": 50.0, "replicate": 0.0, "fed": 400.0}
    ledger.paused = True
    ledger.record("fed", "all_reduce", 400, 2)
    assert ledger.close_step()["fed"] == 0.0
    assert ledger.mean_per_step() == {"shard": 25.0, "replicate": 0.0, "fed": 200.0}


def test_unknown_tier_is_rejected():
    with pytest.raises(ValueError, match="Unknown communication tier 'node'"):
        CommLedger().record("node", "all_reduce", 1, 2)


def test_fsdp_collectives_go_through_torch_distributed_as_it_is_at_call_time(monkeypatch):
    """A wrapper installed on torch.distributed after import (bench/step_profile.py's) sees FSDP's collectives."""
    import torch
    import torch.distributed as dist

    from lightning_fedshard.strategies import ledger as ledger_module

    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_single", lambda *args, **kwargs: calls.append("all_gather"))
    monkeypatch.setattr(dist, "reduce_scatter_single", lambda *args, **kwargs: calls.append("reduce_scatter"))
    ledger = CommLedger()
    ledger_module._CountingAllGather(ledger)(torch.zeros(4), torch.zeros(2), group=None)
    ledger_module._CountingReduceScatter(ledger)(torch.zeros(2), torch.zeros(4), group=None, op=None)
    assert calls == ["all_gather", "reduce_scatter"]
    assert ledger.close_step()["shard"] == 16.0  # 16 bytes gathered + 16 reduce-scattered, each ×(n-1)/n
