"""``StepProfiler``: each step's wall time cut into parts that add up to it, against a scripted clock and against
the step times of a real (single-process) Lightning run measured by a callback of the test's own."""

from __future__ import annotations

import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedshard.bench import step_profile
from lightning_fedshard.bench.step_profile import (
    PARTS,
    StepProfiler,
    format_profiles,
    mean_profile,
    read_profiles,
)


class ScriptedClock:
    """Wall and CPU time that move only when the scripted work says so."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def work(self, wall: float, cpu: float | None = None) -> None:
        self.wall += wall
        self.cpu += wall if cpu is None else cpu


class ScriptedAverager:
    """A federated averager whose send holds a world collective, and whose apply waits first, as FedAverager's."""

    def __init__(self, clock: ScriptedClock) -> None:
        self.clock = clock

    def start(self, fragment: int) -> int:
        dist.all_reduce(torch.zeros(1))  # the finite-check flag: a collective inside the send
        self.clock.work(2)
        return fragment

    def complete(self, pending: int) -> None:
        self.clock.work(7, cpu=0)  # blocked on the network

    def finish(self, pending: int, alpha: float = 0.0) -> None:
        self.complete(pending)
        self.clock.work(5)


def test_parts_are_exclusive_and_add_up_to_the_counted_steps(tmp_path, monkeypatch):
    clock = ScriptedClock()
    monkeypatch.setattr(step_profile, "time", SimpleNamespace(perf_counter=lambda: clock.wall,
                                                              thread_time=lambda: clock.cpu))  # fmt: skip

    def collective(*args, async_op=False, **kwargs):
        clock.work(0.5 if async_op else 3, cpu=0)  # an async call only issues; its time is where it is waited for

    monkeypatch.setattr(dist, "all_reduce", collective)
    averager = ScriptedAverager(clock)
    trainer = SimpleNamespace(global_step=0, global_rank=0, state=SimpleNamespace(fn=TrainerFn.FITTING),
                              strategy=SimpleNamespace(_averager=averager))  # fmt: skip
    profiler = StepProfiler(str(tmp_path), skip_steps=1)
    profiler.on_train_start(trainer, None)
    for step in range(1, 5):
        clock.work(1)  # loading the batch
        profiler.on_train_batch_start(trainer, None, None, step - 1)
        clock.work(10)
        dist.all_reduce(torch.zeros(1))
        dist.all_reduce(torch.zeros(1), async_op=True)
        profiler.on_before_backward(trainer, None, None)
        clock.work(20)
        profiler.on_after_backward(trainer, None)
        clock.work(1)
        profiler.on_before_optimizer_step(trainer, None, None)
        clock.work(4)
        if step == 2:
            averager.start(0)
        if step == 4:
            averager.finish(0)
        trainer.global_step = step
        profiler.on_train_batch_end(trainer, None, None, None, step - 1)
        if step == 3:
            profiler.on_validation_start(trainer, None)
            clock.work(100)  # validation: no step's
            profiler.on_validation_end(trainer, None)
    clock.work(50)  # the end of fit: no step's
    profiler.on_train_end(trainer, None)

    assert dist.all_reduce is collective and averager.start.__func__ is ScriptedAverager.start  # unwrapped again
    (record,) = read_profiles(tmp_path)
    assert record["steps"] == 3  # steps 2-4; step 1 skipped
    # step 2 starts with the batch loaded after step 1 ended, so three of each part
    expected_wall = {"between steps": 3, "forward": 3 * 10.5, "backward": 60, "other": 3, "optimizer": 12,
                     "collectives": 9, "fragment send": 5, "fragment wait": 7, "fragment apply": 5}  # fmt: skip
    assert record["wall"] == pytest.approx(expected_wall)
    assert record["cpu"] == pytest.approx({**expected_wall, "forward": 30, "collectives": 0, "fragment send": 2,
                                           "fragment wait": 0})  # fmt: skip
    assert sum(record["wall"].values()) == pytest.approx(3 * (1 + 10.5 + 3 + 20 + 1 + 4) + 5 + 7 + 5)  # each once
    assert set(record["wall"]) == set(PARTS)
    step_walls = {int(step): sum(parts.values()) for step, parts in record["per_step"].items()}
    assert step_walls == pytest.approx({2: 39.5 + 5, 3: 39.5, 4: 39.5 + 12})  # validation after step 3 in none


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)  # steps long enough that the loop's own microseconds do not matter
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        time.sleep(0.05)  # validation must not count in any step
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepTimes(Callback):
    """The reference: wall time between the ends of consecutive training steps, validation taken out."""

    def __init__(self) -> None:
        self.ends: list[tuple[int, float]] = []
        self.validations: list[tuple[int, float]] = []  # (after step, seconds)

    def on_train_batch_end(self, trainer, *args):
        self.ends.append((trainer.global_step, time.perf_counter()))

    def on_validation_start(self, trainer, pl_module):
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        self.validations.append((trainer.global_step, time.perf_counter() - self._validation_start))


def test_parts_add_up_to_the_wall_time_of_a_real_run(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=4)
    reference = StepTimes()
    profiler = StepProfiler(str(tmp_path), skip_steps=2)
    trainer = pl.Trainer(max_steps=10, val_check_interval=5, limit_val_batches=2, num_sanity_val_steps=0,
                         callbacks=[reference, profiler], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(Tiny(), data, data)
    (record,) = read_profiles(tmp_path)
    start, end = dict(reference.ends)[2], dict(reference.ends)[10]
    validation = sum(seconds for step, seconds in reference.validations if step < 10)  # after step 5
    wall = end - start - validation  # steps 3..10
    assert record["steps"] == 8
    assert sum(record["wall"].values()) == pytest.approx(wall, rel=0.02, abs=2e-3)
    assert record["wall"]["forward"] > 0 and record["wall"]["backward"] > 0 and record["wall"]["optimizer"] > 0
    assert all(seconds >= 0 for seconds in [*record["wall"].values(), *record["cpu"].values()])
    assert record["threads"]["main"] > 0 and all(0 <= busy <= 1 for busy in record["core_busy"])
    assert all(0 <= kernel <= busy for kernel, busy in zip(record["core_kernel"], record["core_busy"], strict=True))
    assert sorted(map(int, record["per_step"])) == sorted(map(int, record["preempted"])) == list(range(3, 11))
    assert all(n >= 0 for n in record["preempted"].values())
    per_step = sum(sum(parts.values()) for parts in record["per_step"].values())
    assert per_step == pytest.approx(sum(record["wall"].values()))
    profile = mean_profile([record, record])
    assert profile["step"] == pytest.approx(sum(record["wall"].values()) / 8)
    table = format_profiles({"tiny": profile}).splitlines()
    step_row = next(line for line in table if line.startswith("step "))
    assert f"{1e3 * profile['step']:.1f} (" in step_row and table[-2].startswith("cores busy")


def test_cpu_times_read_every_core_of_proc_stat():
    cores = step_profile.cpu_times()
    with open("/proc/stat") as stat:
        assert len(cores) == sum(line.startswith("cpu") for line in stat) - 1
    assert all(0 <= kernel <= busy <= total for busy, kernel, total in cores)
