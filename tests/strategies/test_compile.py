"""``compile=[TransformerBlock]`` on the FSDP2 strategies: every block's forward compiled (after activation
checkpointing, before sharding) trains to the eager run's losses, the blocks sharing one graph."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_fedshard import FLFSDPStrategy
from lightning_fedshard.models import Llama, LlamaConfig, TransformerBlock
from lightning_fedshard.strategies.apply import apply_compile
from tests.launching import run_isolated


def _losses(backend: str, *flags: str) -> dict:
    result = run_isolated([sys.executable, "tests/strategies/compile_worker.py", backend, *flags], timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_compiled_blocks_with_checkpointing_train_to_the_eager_losses():
    # aot_eager: Dynamo captures each block whole (fullgraph) under FSDP2's and the checkpoint's hooks and AOTAutograd
    # differentiates it, without inductor's C++ build (30 s on the development machine): a few seconds here
    run = _losses("aot_eager", "checkpointing")
    assert run["status"] == ["pass", "pass"] and run["graphs"] == 1  # the two blocks share one compiled graph
    assert run["compiled"] == pytest.approx(run["eager"], rel=1e-5)


@pytest.mark.slow
def test_blocks_compiled_by_inductor_train_to_the_eager_losses():
    run = _losses("inductor")  # ~30 s of C++ builds on the development machine's CPU, cold
    assert run["status"] == ["pass", "pass"] and run["graphs"] == 1
    assert run["compiled"] == pytest.approx(run["eager"], rel=1e-5)


def test_compile_keeps_the_blocks_types_and_parameter_names():
    model = Llama(LlamaConfig.from_name("llama3.1-micro"))
    names = [name for name, _ in model.named_parameters()]
    assert apply_compile(model, [TransformerBlock]) == 2
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints and exports see the same model
    assert all(type(block) is TransformerBlock for block in model.layers)
    assert all("forward" in vars(block) for block in model.layers)  # compiled per instance, not on the class


def test_the_strategy_resolves_compile_classes_by_import_path():
    strategy = FLFSDPStrategy(num_groups=1, compile=["lightning_fedshard.models.TransformerBlock"])
    assert strategy.options.compile == (TransformerBlock,)
    with pytest.raises(TypeError, match="list of module classes"):
        FLFSDPStrategy(num_groups=1, compile="lightning_fedshard.models.TransformerBlock")
