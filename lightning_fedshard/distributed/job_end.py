"""How the processes of one distributed run end: a failure on one ends all of them, a SIGTERM stop exits 143.

A rank that fails (a collective timed out, a peer vanished, an error of its own) exits non-zero, but its peers
may not: one stopped with SIGSTOP or frozen outside any collective stays behind, and under Lightning's launcher
nobody is left to end it. So each rank learns at set-up which processes on its machine are its peers, and a rank
that fails leaves a watcher behind when it exits (:mod:`~lightning_fedshard.distributed.processes`): it kills a
stopped peer at once and the others still running after a grace period. The failed rank itself exits at once,
so that peers waiting for it in a collective see its connections close and report their own error.
"""

from __future__ import annotations

import atexit
import logging
import signal
import subprocess
import sys
from functools import cached_property
from types import FrameType

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

from lightning_fedshard.compat import set_sigterm_broadcast, set_sigterm_notifier, signal_connector
from lightning_fedshard.distributed import processes
from lightning_fedshard.distributed.elastic import check_elastic_restarts
from lightning_fedshard.distributed.processes import RunProcess

__all__ = ["END_GRACE_S", "SIGTERM_EXIT_CODE", "JobEnd", "JobEndHooks"]

# the logger of Lightning's own handler, so that the message reads and shows as it did
log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")

#: Exit status of a run stopped cleanly by SIGTERM: the shell's 128 + signal, so schedulers see it did not finish.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
#: Seconds the peers of a failed rank have to end by themselves before they are killed.
END_GRACE_S = 10.0


class JobEnd:
    """Makes the ranks of a run end together after a failure, and a SIGTERM stop exit with status 143.

    A strategy calls :meth:`record` on every rank once the default process group exists, :meth:`setup` from its
    ``setup``, and :meth:`on_exception` from its ``on_exception`` hook; ``failed`` then says whether the run failed.
    :class:`JobEndHooks` makes these calls for a Lightning strategy.

    Example::

        job_end = JobEnd()
        job_end.record()  # on every rank, after init_process_group
        job_end.on_exception(error)  # a failed rank: its peers on this machine end with it at exit
    """

    def __init__(self, grace_s: float = END_GRACE_S) -> None:
        self.grace_s = grace_s
        self.failed = False
        self.peers: tuple[RunProcess, ...] = ()
        """The other ranks' processes on this machine, once :meth:`record` ran."""

    def record(self) -> None:
        """Learns the peers on this machine: one ``all_gather_object``, on every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        this = RunProcess.this()
        everyone: list[RunProcess | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, this)
        self.peers = tuple(p for p in everyone if p is not None and p.machine == this.machine and p.pid != this.pid)

    def setup(self, trainer: pl.Trainer) -> None:
        """Makes a SIGTERM on any rank stop every rank of a multi-process fit at the same step.

        Lightning's handler broadcasts from inside the signal handler, wherever the main thread is: with process
        groups besides the world (a device mesh's, FSDP's) that broadcast meets another collective and the ranks
        wait out their timeout. And a rank that saw the signal during a batch leaves at that batch's end while the
        others, whose handlers ran later, go on to the next and wait for it. Here the handler only notes the signal
        (and forwards it to the ranks the launcher started, as Lightning's does), and the collective that opens
        each training batch (Lightning's broadcast of rank 0's flag) becomes a MAX over every rank's note, after
        which all stop together. Outside ``fit`` the flag is raised at once, as Lightning does (without the
        broadcast). Call it from ``Strategy.setup``, before the trainer registers its signal handlers.
        """
        if trainer.world_size == 1:
            return
        connector = signal_connector(trainer)
        noted = synchronised = False

        def note_sigterm(signum: int, frame: FrameType | None) -> None:
            nonlocal noted
            log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
            launcher = trainer.strategy.launcher
            if not noted and launcher is not None:
                launcher.kill(signum)
            noted = True
            if not synchronised:
                connector.received_sigterm = True

        def agree_on_sigterm() -> None:
            flag = torch.tensor([int(noted)], device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                connector.received_sigterm = True
                raise SIGTERMException

        fitting = trainer.state.fn == TrainerFn.FITTING
        synchronised = fitting and set_sigterm_broadcast(trainer.fit_loop.epoch_loop, agree_on_sigterm)
        set_sigterm_notifier(connector, note_sigterm)

    def on_exception(self, exception: BaseException) -> None:
        """A SIGTERM stop keeps its clean shutdown and exits 143; any other exception ends the peers at exit."""
        if isinstance(exception, SIGTERMException):
            if exception.code is None:  # Lightning raises it without a status, which exits 0 like a finished run
                exception.code = SIGTERM_EXIT_CODE
            return
        if not self.failed:
            self.failed = True
            atexit.register(_leave_watcher, self.peers, self.grace_s)


class JobEndHooks:
    """Mixin for a Lightning strategy whose ranks end together after a failure and exit 143 after a SIGTERM stop:
    it calls its :class:`JobEnd` (``self.job_end``) once the default process group exists, from ``setup`` and from
    ``on_exception``. Before the default process group starts it refuses a ``torchrun --max-restarts`` whose
    restarts would hang (:func:`~lightning_fedshard.distributed.elastic.check_elastic_restarts`).

    A strategy that replaces Lightning's ``setup`` without calling ``super().setup`` calls
    ``self.job_end.setup(trainer)`` from its own.

    Example::

        class MyStrategy(JobEndHooks, DDPStrategy):
            pass
    """

    @cached_property
    def job_end(self) -> JobEnd:
        return JobEnd()

    # The default process group is set up by ``DDPStrategy.setup_distributed`` and
    # ``ModelParallelStrategy._setup_distributed``; a torchrun that could not restart the ranks cleanly is refused
    # before it, and the peers are learnt right after, before any other collective.
    def setup_distributed(self) -> None:
        check_elastic_restarts()
        super().setup_distributed()  # type: ignore[misc]
        self.job_end.record()

    def _setup_distributed(self) -> None:
        check_elastic_restarts()
        super()._setup_distributed()  # type: ignore[misc]
        self.job_end.record()

    def setup(self, trainer: pl.Trainer) -> None:
        self.job_end.setup(trainer)
        super().setup(trainer)  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        self.job_end.on_exception(exception)


def _leave_watcher(peers: tuple[RunProcess, ...], grace_s: float) -> None:
    if not peers:
        return
    records = [f"{p.pid}:{p.start_time or '-'}" for p in peers]
    # -I: the watcher needs only the standard library, and a new session keeps it out of the job's terminal signals
    subprocess.Popen(
        [sys.executable, "-I", processes.__file__, str(grace_s), *records],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
