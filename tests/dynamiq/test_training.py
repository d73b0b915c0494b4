"""Training with compressed communication through Lightning: the plugin, ddp_dynamiq, FSDP2 and FedAvg."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_fedshard import FLHSDPStrategy
from lightning_fedshard.bench.costmodel import ShardedSizes, Workload, fed_sync_bytes
from lightning_fedshard.dynamiq import Compression, DynamiQ
from lightning_fedshard.strategies.dims import FedShardDims
from tests.dynamiq.train_worker import Regression
from tests.launching import run_isolated

WORKER = Path(__file__).with_name("train_worker.py")
STEPS = 16
DDP_CASES = {
    "ddp": {"strategy": "ddp"},
    "ddp_plugin": {"strategy": "ddp", "plugin": {"bits": 5.0, "min_numel": 1024}},
    "ddp_dynamiq": {"strategy": "ddp_dynamiq", "strategy_kwargs": {"min_numel": 1024, "process_group_backend": "gloo"}},
    # several buckets: PowerSGD on gloo needs each bucket finished before the next (DynamiQDDPStrategy does it)
    "powersgd": {
        "strategy": "ddp_dynamiq",
        "strategy_kwargs": {"process_group_backend": "gloo", "bucket_cap_mb": 0.1},
        "powersgd": True,
    },
    "fsdp2_plugin": {
        "strategy": "fsdp2",
        "strategy_kwargs": {"shard_size": 4},
        "plugin": {"bits": 5.0, "min_numel": 1024, "traffic": ["gradients"]},
    },
    "fl_hsdp_plugin": {
        "strategy": "fl_hsdp",
        "strategy_kwargs": {"num_groups": 2, "replicate_size": 2, "shard_size": 1, "sync_every": 4},
        "plugin": {"bits": 5.0, "min_numel": 1024, "precision": "bf16-mixed"},
    },
}


# the cases only the benchmarks (-m slow) need; the others share one launch (the interpreters start once)
SLOW_ONLY = {"ddp_dynamiq"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def launch(name: str) -> list[dict]:
        if name not in cache:
            names = [name] if name in SLOW_ONLY else [n for n in DDP_CASES if n not in SLOW_ONLY | cache.keys()]
            root = tmp_path_factory.mktemp(name)
            runs = []
            for each in names:
                (root / each).mkdir()
                runs.append({"devices": 4, "max_steps": STEPS, "lr": 0.05, "out": str(root / each), **DDP_CASES[each]})
            (root / "config.json").write_text(json.dumps({"runs": runs}))
            result = run_isolated([sys.executable, str(WORKER), str(root / "config.json")], timeout=300 + 60 * len(runs))
            assert result.returncode == 0, result.stderr[-6000:]
            for each in names:
                cache[each] = [torch.load(root / each / f"rank{r}.pt", weights_only=False) for r in range(4)]
        return cache[name]

    return launch


def tail_loss(ranks: list[dict]) -> float:
    return sum(sum(r["losses"][-4:]) for r in ranks) / (4 * len(ranks))


def assert_replicas_identical(ranks: list[dict]) -> None:
    for record in ranks[1:]:
        for name, value in ranks[0]["final"].items():
            assert torch.equal(value, record["final"][name]), name


@pytest.mark.multiproc
def test_the_plugin_compresses_ddp_gradients_on_cpu_and_training_follows_fp32(run) -> None:
    plain, compressed = run("ddp"), run("ddp_plugin")
    assert_replicas_identical(compressed)
    bits = [step["dynamiq/gradients/bits_per_coord"] for step in compressed[0]["metrics"]]
    assert len(bits) == STEPS and all(4.5 < b <= 5.0 for b in bits)
    assert compressed[0]["losses"] != plain[0]["losses"]  # the hook ran: Lightning alone skips hooks on CPU
    assert tail_loss(compressed) == pytest.approx(tail_loss(plain), rel=0.03)


@pytest.mark.multiproc
@pytest.mark.slow  # 32 s of training to show two spellings build one hook; with the benchmarks, for CI's 20 min
def test_ddp_dynamiq_is_the_same_hook_as_the_plugin(run) -> None:
    assert [r["losses"] for r in run("ddp_dynamiq")] == [r["losses"] for r in run("ddp_plugin")]


@pytest.mark.multiproc
def test_ddp_dynamiq_runs_a_user_hook_on_cpu(run) -> None:
    powersgd, plain = run("powersgd"), run("ddp")
    assert_replicas_identical(powersgd)
    assert powersgd[0]["losses"][:2] == plain[0]["losses"][:2]  # plain all-reduce before start_powerSGD_iter
    assert powersgd[0]["losses"][2:] != plain[0]["losses"][2:]
    assert tail_loss(powersgd) < powersgd[0]["losses"][0]


@pytest.mark.multiproc
def test_fsdp2_reduce_scatter_is_compressed_and_counted_in_the_ledger(run) -> None:
    compressed, plain = run("fsdp2_plugin"), run("ddp")
    step = compressed[0]["metrics"][-1]
    assert 4.5 < step["dynamiq/gradients/bits_per_coord"] <= 5.0
    # the ledger's shard tier = the compressed reduce-scatter bytes + FSDP2's fp32 all-gathers
    assert step["comm/shard_bytes"] > step["dynamiq/gradients/wire_bytes"] > 0
    assert_replicas_identical(compressed)
    assert tail_loss(compressed) == pytest.approx(tail_loss(plain), rel=0.03)


@pytest.mark.multiproc
def test_fl_hsdp_compresses_fedavg_and_composes_with_bf16_mixed(run) -> None:
    ranks = run("fl_hsdp_plugin")
    assert all(r["forward_dtypes"] == ["torch.bfloat16"] for r in ranks)
    syncs = [s for s in ranks[0]["metrics"] if s["comm/fed_bytes"] > 0]
    assert len(syncs) == STEPS // 4
    assert all(4.5 < s["dynamiq/fed/bits_per_coord"] <= 5.0 for s in syncs)
    assert all(s["comm/fed_bytes"] == s["dynamiq/fed/wire_bytes"] for s in syncs)
    # the run ends on a sync: every rank of every group holds the same consensus, bit for bit
    assert_replicas_identical(ranks)
    assert tail_loss(ranks) < ranks[0]["losses"][0]


@pytest.mark.multiproc
def test_compressed_fedavg_bytes_equal_the_cost_model(run) -> None:
    ranks = run("fl_hsdp_plugin")
    plugin = DDP_CASES["fl_hsdp_plugin"]["plugin"]
    compression = Compression(bits=plugin["bits"], min_numel=plugin["min_numel"])
    numel = sum(p.numel() for p in Regression({}).net.parameters())  # shard_size 1: every rank averages all of it
    workload = Workload(FedShardDims(2, 2, 1), ShardedSizes.ideal(numel, 1, units=1, root_numel=numel),
                        sync_every=4, fed_compression=compression)  # fmt: skip
    expected = float(torch.tensor(fed_sync_bytes(workload)["fed"], dtype=torch.float32))  # logged as float32
    for rank in ranks:
        syncs = [s["comm/fed_bytes"] for s in rank["metrics"] if s["comm/fed_bytes"] > 0]
        assert syncs == [expected] * (STEPS // 4)
    # below 5 bits per coordinate of the exact fp32 ring, which sends 2·(F-1)/F·numel·4 bytes
    assert expected < 5 / 32 * numel * 4


def test_plugin_settings_are_checked_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="traffic"):
        DynamiQ(traffic=("weights",))
    with pytest.raises(ValueError, match="unsupported precision"):
        DynamiQ(precision="8-bit")
    with pytest.raises(ValueError, match="Unknown codec 'zip'"):
        DynamiQ(codec="zip")
    with pytest.raises(ValueError, match="Unknown topology"):
        Compression(topology="tree")
    with pytest.raises(ValueError, match="bits per coordinate"):
        Compression(bits=1.0)
    for bits in (float("nan"), float("inf"), 0.0):  # the fixed formats ignore bits, but not a meaningless one
        with pytest.raises(ValueError, match=f"bits must be a positive, finite number .* got {bits}"):
            Compression(codec="bf16", bits=bits)
    with pytest.raises(ValueError, match="DynamiQ sends 1.469 to 8.469 bits per coordinate .* got bits=16"):
        DynamiQ(bits=16)


def test_the_plugin_is_the_trainers_precision_and_keeps_the_composed_one() -> None:
    plugin = DynamiQ(bits=5.0, precision="bf16-mixed")
    strategy = FLHSDPStrategy(num_groups=2, replicate_size=2, shard_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, plugins=[plugin], logger=False)
    assert trainer.precision_plugin is plugin and trainer.strategy.precision_plugin.precision == "bf16-mixed"
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
