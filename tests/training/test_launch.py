"""``fedshard launch``: torchrun's agent with workers forked from a warm forkserver.

A real 2-rank launch where rank 1 dies in the first attempt: the agent restarts both ranks in place, their
rendezvous works (a process group and a sub-group, which a restart on torchrun's shared store breaks), and the
restarted ranks start with torch already imported, forked by the same forkserver as the first ones."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from lightning_fedshard.training.launch import main as launch_main
from lightning_fedshard.training.launch import run_program
from tests.launching import run_isolated

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    warm = "torch" in sys.modules and "lightning.pytorch" in sys.modules  # before this script imports anything
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    total = torch.ones(1)
    dist.all_reduce(total, group=dist.new_group([0, 1]))
    record = {"name": __name__, "argv": sys.argv[1:], "warm": warm, "ppid": os.getppid(), "total": total.item()}
    with open(os.path.join(sys.argv[1], f"rank{rank}_attempt{attempt}.json"), "w") as f:
        json.dump(record, f)
    if attempt == 0 and rank == 1:
        os._exit(9)  # dies with the process group up: the agent must stop rank 0 and start both again
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.multiproc
def test_a_rank_that_dies_is_restarted_in_place_from_the_warm_forkserver(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
    result = run_isolated(
        [sys.executable, "-m", "lightning_fedshard.cli", "launch", *command, str(script), str(tmp_path)]
    )
    assert result.returncode == 0, result.stderr[-4000:]  # attempt 1 finished
    records = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("rank*_attempt*.json")}
    assert sorted(records) == ["rank0_attempt0", "rank0_attempt1", "rank1_attempt0", "rank1_attempt1"]
    (forkserver,) = {record["ppid"] for record in records.values()}  # one warm interpreter forked all four
    for record in records.values():
        assert record == {"name": "__main__", "argv": [str(tmp_path)], "warm": True, "ppid": forkserver, "total": 2.0}


def test_a_worker_runs_a_fedshard_command_as_the_fedshard_command_line_would(capsys):
    run_program("command", "recipes")
    assert "tiny/fl_hsdp" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node=2", "--master-port=29999", "--max-restarts=1", "fit"], "--max-restarts needs a c10d"),
        (["--standalone", "--no-python", "train"], "--no-python: a program that is not Python"),
    ],
)
def test_a_launch_that_could_not_restart_warm_is_refused_before_it_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch_main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
