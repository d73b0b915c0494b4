"""``fedshard launch``: torchrun whose workers, and their restarts, fork from an interpreter that is warm.

torchrun starts each worker, and each worker again at every restart, as a new interpreter, which spends most of a
restart importing torch, Lightning, datasets and torchft (about 4 s of one rank's start on an idle core here, more
on a busy one). ``fedshard launch`` takes torchrun's options (its argument parser and its agent,
``elastic_launch``) and runs the program in workers forked from a forkserver that imported those modules once
(:data:`PRELOAD`): a restarted rank pays a fork instead. The program is a fedshard command (``fit --config ...``),
a module (``-m package.module ARGS``) or a script (``train.py ARGS``), run as ``__main__``. It also gives each
restart a rendezvous store of its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and refuses restarts under the
static rendezvous, where they would hang (:mod:`lightning_fedshard.distributed.elastic`).

Example::

    REPLICA_GROUP_ID=1 fedshard launch --standalone --nproc-per-node=4 --max-restarts=10 \\
        fit --config tiny/fl_fsdp --trainer.devices=4
    fedshard launch --rdzv-backend=c10d --rdzv-endpoint=head:29600 --nproc-per-node=4 --max-restarts=10 train.py
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import runpy
import sys
import uuid
from argparse import Namespace

from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from lightning_fedshard.distributed.elastic import SHARE_STORE_SWITCH

__all__ = ["PRELOAD", "main"]

#: What the forkserver imports once for every worker it forks (those installed).
PRELOAD = ("lightning_fedshard.training.cli", "lightning_fedshard.strategies", "datasets", "torchft")


def run_program(kind: str, program: str, *argv: str) -> None:
    """One worker: ``program`` with its arguments ``argv``, a fedshard command (``kind="command"``, e.g. ``fit``), a
    module (``"module"``) or a script's path (``"script"``), the last two as ``__main__``."""
    if kind == "command":
        from lightning_fedshard.cli import main as fedshard_main

        fedshard_main([program, *argv])
        return
    sys.argv = [program, *argv]
    if kind == "module":
        runpy.run_module(program, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))  # as `python train.py` would
        runpy.run_path(program, run_name="__main__")


def _single_node_rendezvous(args: Namespace) -> None:
    """torchrun's own choice (``torch.distributed.run.run``): ``--standalone``, or one node without a rendezvous
    endpoint or master port, gets a c10d rendezvous on a free local port."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    unset = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
    if args.standalone or (unset and max_nodes == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def main(argv: list[str]) -> None:
    parser = get_args_parser()
    parser.prog = "fedshard launch"
    parser.description = __doc__.split("\n\n")[0]
    args = parser.parse_args(argv)
    if args.no_python:
        parser.error("--no-python: a program that is not Python cannot be forked from a warm interpreter; use torchrun")
    if args.module:
        kind = "module"
    elif args.run_path or args.training_script.endswith(".py") or os.path.isfile(args.training_script):
        kind = "script"
    else:
        kind = "command"
    _single_node_rendezvous(args)
    if args.rdzv_backend == "static" and args.max_restarts > 0:
        parser.error(
            "--max-restarts needs a c10d rendezvous (`--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT`, or"
            " --standalone on one machine): under the static one a restarted rank would read its dead"
            " predecessor's address from the agent's store and hang."
        )
    os.environ.setdefault(SHARE_STORE_SWITCH, "1")
    args.start_method = "forkserver"
    config, _, _ = config_from_args(args)
    multiprocessing.set_forkserver_preload([name for name in PRELOAD if importlib.util.find_spec(name) is not None])
    elastic_launch(config=config, entrypoint=run_program)(kind, args.training_script, *args.training_script_args)
