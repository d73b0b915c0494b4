"""How a run's processes end (lightning_fedshard.distributed), in one process: the watcher kills what cannot end by
itself and spares what can, a SIGTERM stop gets status 143, and every device-mesh group gets the timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_fedshard.distributed import SIGTERM_EXIT_CODE, JobEnd, init_device_mesh_with_timeout, processes
from lightning_fedshard.distributed.processes import RunProcess, end_processes
from lightning_fedshard.strategies.dims import MESH_DIM_NAMES, FedShardDims


@pytest.fixture
def spawn():
    """``spawn(seconds)``: a ``sleep`` child process, killed at the end of the test if still there."""
    children: list[subprocess.Popen] = []

    def start(seconds: float) -> subprocess.Popen:
        children.append(subprocess.Popen(["sleep", str(seconds)]))
        return children[-1]

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_a_stopped_or_hung_process_is_killed_and_one_that_ends_by_itself_is_not(spawn):
    stopped, hung, finishing = spawn(60), spawn(60), spawn(0.1)
    os.kill(stopped.pid, signal.SIGSTOP)
    end_processes([RunProcess.of(p.pid) for p in (stopped, hung, finishing)], grace_s=2.0)
    assert stopped.wait(timeout=10) == -signal.SIGKILL
    assert hung.wait(timeout=10) == -signal.SIGKILL
    assert finishing.wait(timeout=10) == 0


def test_a_recycled_pid_is_not_taken_for_the_peer(spawn):
    other = spawn(60)
    recorded = RunProcess.of(other.pid)
    assert recorded.start_time is not None
    recycled = RunProcess(recorded.machine, other.pid, str(int(recorded.start_time) - 1))  # same pid, earlier start
    assert recycled.state() is None
    end_processes([recycled], grace_s=0.0)
    assert other.poll() is None


def test_the_watcher_runs_as_a_script_without_the_package(spawn):
    stopped = spawn(60)
    os.kill(stopped.pid, signal.SIGSTOP)
    record = RunProcess.of(stopped.pid)
    watcher = subprocess.run(
        [sys.executable, "-I", processes.__file__, "30", f"{record.pid}:{record.start_time}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert watcher.returncode == 0, watcher.stderr
    assert f"killing process {stopped.pid} of the failed run (stopped)" in watcher.stderr
    assert stopped.wait(timeout=10) == -signal.SIGKILL


def test_a_sigterm_stop_exits_143_and_keeps_the_clean_shutdown(monkeypatch):
    registered = []
    monkeypatch.setattr("atexit.register", lambda *args: registered.append(args))
    job_end = JobEnd()
    stop = SIGTERMException()
    assert stop.code is None  # as Lightning raises it: the process would exit 0
    job_end.on_exception(stop)
    assert stop.code == SIGTERM_EXIT_CODE == 143
    assert not job_end.failed and not registered
    job_end.on_exception(RuntimeError("Timed out waiting 8000ms for recv operation to complete"))
    job_end.on_exception(RuntimeError("a second error registers nothing more"))
    assert job_end.failed and len(registered) == 1


@pytest.fixture
def one_rank_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_every_mesh_group_gets_the_timeout(one_rank_world):
    timeout = timedelta(seconds=7)
    mesh = FedShardDims(1, 1, 1).build_mesh("cpu", timeout)
    assert {name: group_timeout(mesh.get_group(name)) for name in MESH_DIM_NAMES} == dict.fromkeys(
        MESH_DIM_NAMES, timeout
    )
    verifier_mesh = init_device_mesh_with_timeout("cpu", (1, 1), ("data_parallel", "tensor_parallel"), timeout)
    assert group_timeout(verifier_mesh.get_group("tensor_parallel")) == timeout
    # what torch gives a mesh's groups otherwise: its 30-minute default, whatever the world group's timeout
    assert group_timeout(FedShardDims(1, 1, 1).build_mesh("cpu").get_group("shard")) == timedelta(minutes=30)


AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}


@pytest.mark.parametrize(
    "environ, refused",
    [
        (AGENT_STORE, True),  # static rendezvous, or c10d sharing its store: a restart reads stale addresses
        ({**AGENT_STORE, "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # c10d with a store per restart
        ({**AGENT_STORE, "TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # nothing is ever restarted
        ({}, False),  # not under torchrun
    ],
)
def test_a_torchrun_whose_restarts_would_reuse_the_agents_store_is_refused(environ, refused):
    from lightning_fedshard.distributed import check_elastic_restarts

    if not refused:
        check_elastic_restarts(environ)
        return
    with pytest.raises(RuntimeError, match="--max-restarts=3 .* TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_elastic_restarts(environ)


@pytest.mark.parametrize(
    "strategy, starts_group",  # the Lightning method that starts the default process group
    [("fsdp2", "_setup_distributed"), ("ddp_dynamiq", "setup_distributed"), ("timed_mp", "_setup_distributed")],
)
def test_every_strategy_refuses_such_a_torchrun_before_its_process_group_starts(strategy, starts_group, monkeypatch):
    import lightning.pytorch as pl

    import lightning_fedshard  # noqa: F401  (registers the strategy names)
    from lightning_fedshard.distributed import TimedModelParallelStrategy

    def started(*args, **kwargs):  # instead of waiting for an agent's store that is not there
        raise AssertionError("the default process group was started")

    for key, value in AGENT_STORE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist, "init_process_group", started)
    chosen = TimedModelParallelStrategy() if strategy == "timed_mp" else strategy
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=chosen, logger=False)
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        getattr(trainer.strategy, starts_group)()
