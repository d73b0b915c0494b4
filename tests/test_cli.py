"""``fedshard``: LightningCLI parsing of every recipe, and bad input rejected before any process starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedshard import DynamiQDDPStrategy, FLFSDPStrategy, FLHSDPStrategy
from lightning_fedshard.cli import FedShardCLI, main
from lightning_fedshard.recipes import RECIPES as SHIPPED

LAYOUTS = {
    "fsdp2": (FLFSDPStrategy, 1),
    "hsdp": (FLHSDPStrategy, 1),
    "fl_fsdp": (FLFSDPStrategy, None),
    "fl_hsdp": (FLHSDPStrategy, None),
}
RECIPES = sorted(p for p in SHIPPED.glob("*/*.yaml") if p.stem in LAYOUTS)
# the reference experiment's layouts at 512 GPUs: (groups, replicas, shards)
REFERENCE_8B = {"fsdp2": (1, 1, 512), "hsdp": (1, 128, 4), "fl_fsdp": (128, 1, 4), "fl_hsdp": (16, 8, 4)}


@pytest.fixture(autouse=True)
def no_pytest_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["fedshard"])  # LightningCLI(args=...) warns about any other argv


def print_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *args, "--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_every_layout_has_a_tiny_and_an_8b_recipe():
    assert {(p.parent.name, p.stem) for p in RECIPES} == {(m, s) for m in ("tiny", "llama3.1-8b") for s in LAYOUTS}
    others = {p.relative_to(SHIPPED) for p in SHIPPED.glob("*/*.yaml") if p.stem not in LAYOUTS}
    assert others == {Path("tiny/ddp_dynamiq.yaml"), *(Path(m, "fl_hsdp_muon.yaml") for m in ("tiny", "llama3.1-8b"))}


@pytest.mark.parametrize("size", ["tiny", "llama3.1-8b"])
def test_the_muon_recipes_are_fl_hsdp_with_muon_as_the_inner_optimizer(size, capsys):
    muon = print_config(capsys, "--config", f"{size}/fl_hsdp_muon")
    baseline = print_config(capsys, "--config", f"{size}/fl_hsdp")
    assert (muon["model"].pop("optimizer"), baseline["model"].pop("optimizer")) == ("muon", "adamw")
    # the tiny recipe's lr was tuned for Muon (docs/benchmarks.md); the 8B one keeps AdamW's (Moonshot's scaling)
    lrs = (muon["model"].pop("lr"), baseline["model"].pop("lr"))
    assert lrs == ((2e-2, 3e-3) if size == "tiny" else (3e-4, 3e-4))
    strategy = muon["trainer"]["strategy"]["init_args"]
    assert FLHSDPStrategy(**strategy).shard_block == strategy.pop("shard_block")
    baseline["trainer"]["strategy"]["init_args"].pop("shard_block")
    for config in (muon, baseline):
        config["trainer"]["logger"]["init_args"].pop("name")
    assert muon == baseline


def test_the_compression_recipe_differs_from_fsdp2_only_in_strategy_and_run_name(capsys):
    compressed = print_config(capsys, "--config", "tiny/ddp_dynamiq")
    baseline = print_config(capsys, "--config", "tiny/fsdp2")
    strategy = compressed["trainer"].pop("strategy")
    assert strategy["class_path"] == "lightning_fedshard.DynamiQDDPStrategy"
    assert DynamiQDDPStrategy(**strategy["init_args"]).hook_state.compression.bits == 5.0
    baseline["trainer"].pop("strategy")
    for config in (compressed, baseline):
        config["trainer"]["logger"]["init_args"].pop("name")
    assert compressed == baseline


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_parses_and_its_strategy_fits_its_cluster(recipe, capsys):
    config = print_config(capsys, "--config", str(recipe))
    trainer, model, data = config["trainer"], config["model"], config["data"]
    cls, groups = LAYOUTS[recipe.stem]
    strategy = trainer["strategy"]
    assert strategy["class_path"] == f"lightning_fedshard.{cls.__name__}"
    assert "seq_len" not in model  # linked from data.seq_len
    # the strategy the YAML describes can be built and its mesh fills the recipe's world exactly
    built = cls(**strategy["init_args"])
    dims = built.layout(trainer["num_nodes"], trainer["devices"])
    if groups is not None:
        assert dims.num_groups == groups
    if recipe.parent.name == "llama3.1-8b":
        assert (dims.num_groups, dims.replicate_size, dims.shard_size) == REFERENCE_8B[recipe.stem]
        assert (trainer["num_nodes"], trainer["devices"], trainer["precision"]) == (128, 4, "bf16-mixed")
        assert model["preset"] == "llama3.1-8b" and model["lr"] == 3e-4 and model["betas"] == [0.9, 0.95]
        assert model["weight_decay"] == 0.1 and model["warmup_fraction"] == 0.1
        assert data["batch_size"] == 2 and data["seq_len"] == 2048
        assert trainer["max_steps"] * trainer["num_nodes"] * trainer["devices"] * data["batch_size"] == 65536
        if recipe.stem.startswith("fl_"):
            assert built.sync_every == 8
    else:
        assert (trainer["accelerator"], trainer["devices"], model["preset"]) == ("cpu", 4, "llama3.1-tiny")


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_bar_is_on_in_a_terminal_and_off_otherwise(terminal, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    for recipe in RECIPES:  # no recipe decides it
        assert print_config(capsys, "--config", str(recipe))["trainer"]["enable_progress_bar"] is terminal
    off = print_config(capsys, "--config", str(RECIPES[0]), "--trainer.enable_progress_bar=false")
    assert off["trainer"]["enable_progress_bar"] is False


def test_strategies_are_selectable_by_registered_name(capsys):
    for name in ("fl_fsdp", "fl_hsdp", "fsdp2", "hsdp"):
        assert name in StrategyRegistry
        config = print_config(capsys, "--config", str(RECIPES[0]), f"--trainer.strategy={name}")
        assert config["trainer"]["strategy"] == name


def test_strategy_arguments_are_settable_from_the_command_line(capsys):
    recipe = SHIPPED / "tiny" / "fl_hsdp.yaml"
    config = print_config(
        capsys, "--config", str(recipe), "--trainer.strategy.init_args.sync_every=4",
        "--trainer.strategy.init_args.outer_optimizer=nesterov",
    )  # fmt: skip
    assert config["trainer"]["strategy"]["init_args"]["sync_every"] == 4
    assert config["trainer"]["strategy"]["init_args"]["outer_optimizer"] == "nesterov"


def fit_args(*overrides: str) -> list[str]:
    return ["fit", "--config", str(SHIPPED / "tiny" / "fl_hsdp.yaml"), *overrides]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["--data.source=/no/such/corpus"], FileNotFoundError, "'/no/such/corpus' does not exist"),
        (["--model.preset=llama9"], ValueError, "Unknown Llama preset 'llama9'"),
        (["--data.seq_len=2048"], ValueError, r"seq_len=2048 exceeds the rotary context.*max_seq_len=1024"),
        (["--model.preset=llama3.1-micro", "--model.overrides={vocab_size: 100}"], ValueError, "has 257 ids"),
        (["--trainer.strategy.init_args.num_groups=3"], ValueError, "num_groups"),
        (["--trainer.strategy.init_args.outer_lr=0"], ValueError, "`outer_lr` must be a finite number > 0, got 0"),
        (["--trainer.strategy.init_args.timeout=-1 day, 23:59:30"], ValueError, "`timeout` must be a positive"),
    ],
    ids=[
        "missing-data",
        "unknown-preset",
        "seq-len-over-context",
        "vocab-too-small",
        "mesh-does-not-fit",
        "outer-lr-zero",
        "negative-timeout",
    ],
)
def test_bad_input_fails_before_training(overrides, error, match, monkeypatch):
    # No process group may start: the error must come from construction or the checks before fit.
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *a, **k: pytest.fail("fit() was reached"))
    with pytest.raises(error, match=match):
        FedShardCLI(args=fit_args(*overrides))


def test_empty_corpus_is_named_before_training(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *a, **k: pytest.fail("fit() was reached"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"Text corpus at '.*' is empty"):
        FedShardCLI(args=fit_args(f"--data.source={tmp_path}"))


def test_binary_corpus_is_named_before_training(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("lightning.pytorch.Trainer.fit", lambda *a, **k: pytest.fail("fit() was reached"))
    (tmp_path / "notes.txt").write_text("some text")
    (tmp_path / "model.txt").write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match=r"Text corpus file '.*model\.txt' is not UTF-8 text: byte 0 is invalid"):
        FedShardCLI(args=fit_args(f"--data.source={tmp_path}"))
