"""Muon and AdamW8bit on 4 real gloo ranks (one torchrun launch, several checks; see dist_worker.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launching import run_isolated

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("optim")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    result = run_isolated([*launch, str(WORKER), str(out)], timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads((out / "results.json").read_text())


pytestmark = pytest.mark.multiproc


def test_the_shards_are_even_uneven_and_on_dim_1(results):
    run = results[3]["muon_fsdp2"]
    assert "Shard(dim=1)" in run["placements"]["wide.weight"]
    assert [r["muon_fsdp2"]["local_rows"]["b.weight"] for r in results] == [3, 3, 3, 1]


def test_muon_under_fsdp2_equals_the_single_process_step_for_step(results):
    for rank in results:
        assert rank["muon_fsdp2"]["max_diff_per_step"] == pytest.approx([0.0] * 3, abs=1e-6)


def test_every_matrix_is_orthogonalised_on_exactly_one_rank_per_step(results):
    run = results[0]["muon_fsdp2"]
    assert run["ref_orthogonalised"] == list(range(run["matrices"]))  # one process does all four
    owned = run["owned_per_rank"]
    for step in range(3):
        done = sorted(j for rank in owned for j in rank[step])
        assert done == list(range(run["matrices"]))  # each once, none twice
    assert sum(1 for rank in owned if rank[0]) == WORLD  # four matrices, four owners: the work is spread


def test_muon_under_fl_fsdp_equals_each_groups_reference(results):
    for group in (0, 1):
        ranks, key = (2 * group, 2 * group + 1), f"muon_fl_fsdp_group{group}"
        for rank in ranks:
            assert results[rank][key]["max_diff_per_step"] == pytest.approx([0.0] * 3, abs=1e-6)
        run = results[ranks[0]][key]
        for step in range(3):  # inside its group each matrix once, by one of the group's two ranks
            assert sorted(j for r in ranks for j in run["owned_per_rank"][r][step]) == list(range(run["matrices"]))


def test_adamw8bit_under_fsdp2_is_bit_identical_to_the_same_blocks_in_one_process(results):
    for rank in results:
        run = rank["adamw8bit"]
        assert all(run["bit_identical_to_per_shard_reference"].values()), run
        assert all(run["codes_identical_to_per_shard_reference"].values()), run
        assert run["aligned_weight_identical_to_whole_run"]
        assert run["local_code_dtypes"] == ["torch.int8", "torch.uint8"]


@pytest.mark.parametrize("optimizer", ["adamw8bit", "muon"])
def test_dcp_resume_reproduces_the_uninterrupted_run(results, optimizer):
    for rank in results:
        assert all(rank[f"resume_{optimizer}"].values()), rank[f"resume_{optimizer}"]
        uninterrupted, resumed = rank[f"resume_{optimizer}_state_dtypes"]
        assert resumed == uninterrupted  # DCP's load goes through Optimizer.load_state_dict, which casts states
