"""The cost model's formulas against exact arithmetic and the standard ring costs; the ledger check is in
``tests/strategies/test_costmodel_ledger.py`` (real gloo runs)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from lightning_fedshard.bench import costmodel
from lightning_fedshard.bench.costmodel import (
    LEONARDO,
    ShardedSizes,
    Workload,
    compressed_all_reduce_bytes,
    link_bytes,
    mean_step_bytes,
    node_egress_bytes,
    step_bytes,
    step_time,
)
from lightning_fedshard.dynamiq import Compression
from lightning_fedshard.models import LlamaConfig
from lightning_fedshard.strategies.dims import FedShardDims

PSI = 1_000_000  # elements; with 4-byte wire dtypes the model's bytes are 4·PSI


def ideal(dims: FedShardDims, sync_every: int = 8, **kwargs) -> Workload:
    """No padding and no root unit: the textbook ring costs."""
    return Workload(dims, ShardedSizes.ideal(PSI, dims.shard_size, units=10, root_numel=0, root_units=0),
                    sync_every=sync_every, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("dims", "shard", "replicate", "fed"),
    [
        (FedShardDims(1, 1, 8), 3 * 4 * PSI * 7 / 8, 0.0, 0.0),  # FSDP(N): 3Ψ(N-1)/N
        (FedShardDims(1, 4, 2), 3 * 4 * PSI / 2, 2 * (4 * PSI / 2) * 3 / 4, 0.0),  # HSDP: + 2(Ψ/S)(R-1)/R
        (FedShardDims(4, 1, 2), 3 * 4 * PSI / 2, 0.0, 2 * (4 * PSI / 2) * 3 / 4 / 8),  # FL+FSDP: 2(Ψ/G)(F-1)/F/H
        (FedShardDims(2, 2, 2), 3 * 4 * PSI / 2, 2 * (4 * PSI / 2) / 2, 2 * (4 * PSI / 2) / 2 / 8),
    ],
    ids=["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"],
)
def test_ideal_sizes_give_the_standard_ring_costs(dims, shard, replicate, fed):
    assert mean_step_bytes(ideal(dims)) == pytest.approx({"shard": shard, "replicate": replicate, "fed": fed})


def test_rounds_land_on_their_step_and_leader_mode_moves_bytes_to_the_broadcast():
    w = ideal(FedShardDims(2, 2, 2), sync_every=4)
    assert step_bytes(w, syncs=False)["fed"] == 0.0
    assert step_bytes(w, syncs=True)["fed"] == 2 * (4 * PSI / 2) / 2
    leader = dataclasses.replace(w, sync_mode="leader")
    replica0, replica1 = (step_bytes(leader, syncs=True, replicate_rank=r) for r in (0, 1))
    assert replica0["fed"] == 2 * (4 * PSI / 2) / 2 and replica1["fed"] == 0.0
    broadcast = (4 * PSI / 2) / 2  # a broadcast over R = 2 sends t·(R-1)/R per rank on average
    assert replica1["replicate"] - step_bytes(w, syncs=False)["replicate"] == broadcast


def test_micro_batches_and_dtypes_scale_the_inner_tiers_only():
    w = ideal(FedShardDims(2, 2, 2))
    bf16 = dataclasses.replace(w, micro_batches=2, gather_itemsize=2)
    # the gathers halve per element and double per step; reductions double; the round does not change
    assert step_bytes(bf16, syncs=False)["shard"] == pytest.approx(2 * (2 * 2 + 4) * PSI / 2)
    assert step_bytes(bf16, syncs=False)["replicate"] == 2 * step_bytes(w, syncs=False)["replicate"]
    assert step_bytes(bf16, syncs=True)["fed"] == step_bytes(w, syncs=True)["fed"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)  # weight 5×4: dim 0 of 5 rows does not split evenly over 4 ranks


def test_of_module_pads_like_fsdp2_and_gathers_roots_once():
    module = nn.Module()
    module.body = nn.Sequential(Block(), Block())
    module.head = nn.Linear(5, 1)  # a second root unit: weight 1×5 is padded to 4×5
    sizes = [ShardedSizes.of_module(module, 4, auto_wrap=[Block], shard_rank=r) for r in range(4)]
    # per block: weight ⌈5/4⌉ = 2 rows × 4 ranks × 4 columns + bias 2 × 4; body itself holds nothing
    block = 2 * 4 * 4 + 2 * 4
    head = 1 * 4 * 5 + 1 * 4
    assert sizes[0].padded_numel == 2 * block + head
    assert sizes[0].root_padded_numel == head  # body holds no parameters of its own; head is a root
    assert (sizes[0].units, sizes[0].root_units) == (4, 2)
    # torch.chunk rows per rank for 5 rows: 2, 2, 1, 0; head's single row lives on rank 0
    assert [s.local_numel for s in sizes] == [2 * (2 * 4 + 2) + 5 + 1, 2 * (2 * 4 + 2), 2 * (4 + 1), 0]


def test_placement_splits_tiers_into_links_and_rejects_uneven_layouts():
    hsdp = ideal(FedShardDims(1, 4, 2))  # 4 nodes of 2: shard inside nodes, replicate across them
    links = link_bytes(hsdp, devices_per_node=2)
    assert links["intra_node"] == mean_step_bytes(hsdp)["shard"]
    assert links["inter_node"] == mean_step_bytes(hsdp)["replicate"]
    fsdp = ideal(FedShardDims(1, 1, 8))  # one ring over 4 nodes: 4 of its 8 edges leave a node
    assert link_bytes(fsdp, devices_per_node=2)["inter_node"] == pytest.approx(mean_step_bytes(fsdp)["shard"] / 2)
    with pytest.raises(ValueError, match="unevenly"):
        link_bytes(ideal(FedShardDims(1, 1, 3)), devices_per_node=2)


def test_node_egress_counts_every_ring_that_leaves_the_node():
    cluster = dataclasses.replace(LEONARDO, devices_per_node=2, reduce_scatter_factor=2.0)
    hsdp = ideal(FedShardDims(1, 2, 2))  # two replicate rings, each leaving each node once
    assert node_egress_bytes(hsdp, cluster) == 2 * step_bytes(hsdp, syncs=False)["replicate"]
    fsdp = ideal(FedShardDims(1, 1, 4))  # one ring; gloo's reduce-scatter sends twice the ring bytes
    ag, rs = 2 * 4 * PSI * 3 / 4, 4 * PSI * 3 / 4
    assert node_egress_bytes(fsdp, cluster) == pytest.approx(ag + 2 * rs)


def test_step_time_adds_latency_and_bandwidth_terms_and_hides_inner_traffic_with_overlap():
    cluster = dataclasses.replace(
        LEONARDO, devices_per_node=2, peak_flops=1e12, mfu=1.0, inter_node_bandwidth=1e9, inter_node_latency=1e-5,
        intra_node_bandwidth=1e10, intra_node_latency=0.0, call_latency=1e-4, overlap=False,
    )  # fmt: skip
    w = dataclasses.replace(ideal(FedShardDims(1, 2, 2)), tokens_per_step=1000, flops_per_token=1e6)
    t = step_time(w, cluster)
    assert t.compute == pytest.approx(1e-3)
    replicate_bytes = step_bytes(w, syncs=False)["replicate"]
    # 10 all-reduces over 2 nodes (2 hops each); two rings share each node's 1 GB/s
    assert t.comm["replicate"] == pytest.approx(10 * 1e-4 + 10 * 2 * 1e-5 + replicate_bytes / 0.5e9)
    assert t.total == pytest.approx(t.compute + t.comm["shard"] + t.comm["replicate"])
    hidden = step_time(w, dataclasses.replace(cluster, overlap=True))
    assert hidden.total == pytest.approx(max(t.compute, t.comm["shard"] + t.comm["replicate"]))


def test_streaming_hides_each_fragments_average_behind_the_delay_steps_compute():
    # 2 groups of one rank on 2 nodes; compute 1 s per step; the round all-reduces 4 MB (2·4Ψ·(F-1)/F over 2 groups)
    cluster = dataclasses.replace(
        LEONARDO, devices_per_node=1, peak_flops=1.0, mfu=1.0, inter_node_bandwidth=4e6, inter_node_latency=0.0,
        call_latency=0.0, overlap=False,
    )  # fmt: skip
    blocking = dataclasses.replace(ideal(FedShardDims(2, 1, 1), sync_every=4), tokens_per_step=1, flops_per_token=1.0)
    halves = dataclasses.replace(blocking, fragment_shares=(0.5, 0.5), fragment_sync_delay=1)
    assert step_time(blocking, cluster).total == pytest.approx(1 + 1 / 4)  # the 1 s round waits, once per 4 steps
    # two 0.5 s fragment averages, each in flight during one 1 s step: all hidden, the same bytes
    streamed = step_time(halves, cluster)
    assert (streamed.total, streamed.fed_hidden, streamed.comm["fed"]) == pytest.approx((1.0, 1 / 4, 1 / 4))
    assert mean_step_bytes(halves) == mean_step_bytes(blocking)
    # no delay hides nothing; a 4× slower link leaves 2 s - 1 s per fragment waiting
    assert step_time(dataclasses.replace(halves, fragment_sync_delay=0), cluster).total == pytest.approx(1.25)
    slow = dataclasses.replace(cluster, inter_node_bandwidth=1e6)
    assert step_time(halves, slow).total == pytest.approx(1 + 2 * (2 - 1) / 4)
    assert step_time(blocking, slow).total == pytest.approx(1 + 4 / 4)
    # DynamiQ's ring runs in the training thread: staggered, not hidden
    compressed = dataclasses.replace(halves, fed_compression=Compression(bits=5.0))
    assert step_time(compressed, cluster).fed_hidden == 0


def test_dynamiq_round_stays_within_its_bit_budget_and_falls_back_for_small_buckets():
    compression = Compression(bits=5.0)
    exact_ring = 2 * PSI * 3 / 4  # coordinates one rank sends in an exact ring all-reduce over 4
    sent = compressed_all_reduce_bytes(PSI, 4, compression)
    assert 0.9 * 5 / 8 * exact_ring < sent <= 5 / 8 * exact_ring
    w = ideal(FedShardDims(4, 1, 1), fed_compression=Compression(bits=5.0, min_numel=2 * PSI))
    assert costmodel.fed_sync_bytes(w)["fed"] == 2 * 4 * PSI * 3 / 4  # under min_numel: plain fp32


def test_llama_sizes_count_every_parameter():
    config = LlamaConfig.from_name("llama3.1-8b")
    sizes = ShardedSizes.of_llama(config, shard_size=4)
    assert sizes.padded_numel == config.num_parameters == 8_030_261_248
    assert sizes.root_padded_numel == 2 * config.vocab_size * config.dim + config.dim
    assert sizes.units == 33 and sizes.local_numel == config.num_parameters / 4


def test_reference_cluster_speedups_and_the_bandwidth_they_imply():
    fl = costmodel.speedups(LEONARDO)
    assert fl["fl_fsdp"] > 1.2 and fl["fl_hsdp"] > 1.0
    assert costmodel.speedups(LEONARDO, sync_every=1)["fl_fsdp"] < 1  # a blocking fp32 round every step loses
    bandwidth = costmodel.implied_bandwidth(LEONARDO, wire="xffl")
    at = costmodel.speedups(dataclasses.replace(LEONARDO, inter_node_bandwidth=bandwidth), wire="xffl")
    assert max(at.values()) == pytest.approx(costmodel.REFERENCE_SPEEDUP, rel=1e-3)
    assert costmodel.implied_bandwidth(LEONARDO, wire="fedshard") is None  # bounded below 8.04×


def test_cli_prints_the_report_and_rejects_bad_arguments(capsys):
    costmodel.main(["--sync-every", "16"])
    out = capsys.readouterr().out
    assert "fl_fsdp+dynamiq5" in out and "sync every 16 steps" in out and "8.04×" in out
    with pytest.raises(SystemExit):
        costmodel.main(["--mfu", "1.5"])
