"""The recipes live in the checkout's top-level ``recipes/`` and ship inside the package: found by name from any
directory, listed by ``fedshard recipes``, and copied by the build (package data mapped from ``recipes/``), so that
nothing needs the repository root as the working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fedshard.cli import main
from lightning_fedshard.recipes import RECIPES, recipe_file, resolve_config_arguments
from tests.launching import REPO

# every recipe there is, written out here rather than globbed, with the first line of its header comment
EXPECTED = [
    *(f"llama3.1-8b/{layout}" for layout in ("fl_fsdp", "fl_hsdp", "fl_hsdp_muon", "fsdp2", "hsdp")),
    *(f"tiny/{layout}" for layout in ("ddp_dynamiq", "fl_fsdp", "fl_hsdp", "fl_hsdp_muon", "fsdp2", "hsdp")),
]


def _first_comment(path: Path) -> str:
    return path.read_text().splitlines()[0].removeprefix("#").strip()


def test_fedshard_recipes_lists_every_recipe_of_a_build_from_outside_the_checkout(tmp_path):
    # setuptools copies the package data mapped from recipes/ into a build tree (as a wheel would hold it); the
    # listing then runs from an unrelated directory with only that tree importable
    build = tmp_path / "build"
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "build_py", "--build-lib", str(build)],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(build)}
    listing = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard.cli", "recipes"],
        check=False, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr[-3000:]
    lines = [line for line in listing.stdout.splitlines() if line and not line.startswith("Train one")]
    assert [line.split()[0] for line in lines] == EXPECTED
    for name, line in zip(EXPECTED, lines):
        shipped = build / "lightning_fedshard" / "recipes" / "shipped" / f"{name}.yaml"
        assert line.split(None, 1)[1] == _first_comment(shipped) != ""
        assert shipped.read_bytes() == (REPO / "recipes" / f"{name}.yaml").read_bytes()


def test_a_recipe_name_gives_the_same_configuration_as_its_path_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["fedshard"])  # LightningCLI(args=...) warns about any other argv
    monkeypatch.chdir(tmp_path)

    def print_config(*args: str) -> dict:
        with pytest.raises(SystemExit) as exit_:
            main(["fit", *args, "--print_config"])
        assert exit_.value.code in (0, None)
        return yaml.safe_load(capsys.readouterr().out)

    by_path = print_config("--config", str(REPO / "recipes" / "tiny" / "fl_hsdp.yaml"))
    assert print_config("--config", "tiny/fl_hsdp") == by_path
    assert print_config("-c", "tiny/fl_hsdp.yaml") == by_path
    assert print_config("--config=tiny/fl_hsdp") == by_path
    assert by_path["trainer"]["strategy"]["class_path"] == "lightning_fedshard.FLHSDPStrategy"


def test_config_values_that_are_paths_or_inline_yaml_pass_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "hsdp").write_text("seed_everything: 1\n")  # a local file wins over the recipe's name
    args = ["fit", "--config", "tiny/hsdp", "--config", "{seed_everything: 3}", "--trainer.max_steps=2", "-c"]
    assert resolve_config_arguments(args) == args
    assert resolve_config_arguments(["fit", "--config", "tiny/fsdp2"]) == [
        "fit", "--config", str(REPO / "recipes" / "tiny" / "fsdp2.yaml"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            "recipes/tiny/fl_hsdp.yaml",
            r"No file and no recipe named 'recipes/tiny/fl_hsdp.yaml'\. Did you mean 'tiny/fl_hsdp'\?",
        ),
        (
            "tiny/nope",
            r"No file and no recipe named 'tiny/nope'\. Recipes \(`fedshard recipes`\): llama3\.1-8b/fl_fsdp, ",
        ),
        ("../tiny/hsdp", r"No file and no recipe named '\.\./tiny/hsdp'"),
    ],
)
def test_an_unknown_config_is_refused_naming_the_recipes(tmp_path, monkeypatch, value, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=match):
        recipe_file(value)


def test_the_command_line_reports_an_unknown_recipe_as_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["fedshard"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "tiny/fl_hsbp", "--print_config"])
    assert exit_.value.code == 2
    assert "No file and no recipe named 'tiny/fl_hsbp'" in capsys.readouterr().err


def test_gpu_check_writes_under_runs_of_the_working_directory_by_default(tmp_path, monkeypatch):
    from lightning_fedshard.bench.gpu_check import main as gpu_check

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_check([], cuda_available=lambda: False) == 0
    assert sorted(p.name for p in (tmp_path / "runs" / "gpu-check").iterdir()) == ["gpu_check.json", "gpu_check.md"]


def test_bench_entry_points_find_their_recipes_from_any_directory(tmp_path, monkeypatch):
    from lightning_fedshard.bench import optimizers
    from lightning_fedshard.bench.recipes import TINY, fit_arguments

    monkeypatch.chdir(tmp_path)
    # `fedshard bench optimizers --plan`: the 8B recipes' shard plans (it found none outside the checkout)
    optimizers.main(["--plan", "--blocks", "128", "--out", "plans"])
    plans = json.loads((tmp_path / "plans" / "results.json").read_text())["plans"]
    assert list(plans) == [name for name in EXPECTED if name.startswith("llama3.1-8b/")]
    # what `fedshard demo` / `bench recipes` / `bench multitier` hand to each run (it refused outside the checkout)
    arguments = fit_arguments(TINY / "hsdp.yaml", Path("runs/demo"), [], "hsdp")
    assert arguments[:3] == ["fit", "--config", str(RECIPES / "tiny" / "hsdp.yaml")]
