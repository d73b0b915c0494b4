"""The LightningCLI recipes that ship with the package, found by name from any directory.

Each recipe is a YAML file in the checkout's top-level ``recipes/`` folder, named by its path without ``.yaml``
(``tiny/fl_hsdp``, ``llama3.1-8b/hsdp``); the first line of its header comment is its one-line description. The
build maps that folder into the package as ``lightning_fedshard/recipes/shipped/`` (package data, see setup.py),
so they are there after ``pip install`` wherever the command runs: ``fedshard fit --config tiny/fl_hsdp`` and
``fedshard recipes`` (the list) need no checkout, and ``--config recipes/tiny/fl_hsdp.yaml`` works in the
checkout. A ``--config`` value that names an existing file stays a path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RECIPES",
    "Recipe",
    "format_listing",
    "list_recipes",
    "recipe_file",
    "recipes_folder",
    "resolve_config_arguments",
]


def recipes_folder(package: Path = Path(__file__).resolve().parent) -> Path:
    """Where the recipes are: the copy a wheel or a build holds inside ``package``, else (an editable install or
    the checkout on ``PYTHONPATH``) the checkout's top-level ``recipes/``, two levels above ``package``."""
    shipped = package / "shipped"
    return shipped if shipped.is_dir() else package.parents[1] / "recipes"


#: The folder the recipes are read from.
RECIPES = recipes_folder()

_SUFFIX = ".yaml"
_CONFIG_FLAGS = ("--config", "-c")


@dataclass(frozen=True)
class Recipe:
    name: str
    """``size/layout``: what ``--config`` accepts."""
    path: Path
    description: str
    """The first line of the file's header comment."""


def _description(path: Path) -> str:
    with path.open() as f:
        first = f.readline().strip()
    if not first.startswith("#") or not first.lstrip("#").strip():
        raise ValueError(f"Recipe {path} has no description: its first line must be a comment saying what it trains.")
    return first.lstrip("#").strip()


def list_recipes() -> list[Recipe]:
    """Every shipped recipe, sorted by name."""
    return [
        Recipe(path.relative_to(RECIPES).with_suffix("").as_posix(), path, _description(path))
        for path in sorted(RECIPES.glob(f"*/*{_SUFFIX}"))
    ]


def format_listing() -> str:
    """What ``fedshard recipes`` prints: one line per recipe, its name and its description."""
    recipes = list_recipes()
    width = max(len(r.name) for r in recipes)
    lines = [f"{r.name:<{width}}  {r.description}" for r in recipes]
    return "\n".join([*lines, "", "Train one with `fedshard fit --config NAME`; print it with `--print_config`."])


def recipe_file(value: str | Path) -> Path:
    """``value`` as a recipe file: an existing file's path as given, else the shipped recipe of that name
    (``tiny/fl_hsdp``, ``.yaml`` optional). A value that is neither raises, naming the recipes there are."""
    path = Path(value)
    if path.is_file():
        return path
    name = path.as_posix().removesuffix(_SUFFIX)
    shipped = (RECIPES / f"{name}{_SUFFIX}").resolve()
    if shipped.is_relative_to(RECIPES) and shipped.is_file():  # only this folder's files, never ../ or /...
        return shipped
    names = [r.name for r in list_recipes()]
    hint = next((f" Did you mean {n!r}?" for n in names if name.endswith(f"/{n}")), "")
    raise FileNotFoundError(
        f"No file and no recipe named {str(value)!r}.{hint} Recipes (`fedshard recipes`): {', '.join(names)}."
    )


def _is_inline_yaml(value: str) -> bool:
    # jsonargparse also takes a config as a YAML/JSON string; a mapping always has one of these
    return any(c in value for c in ":{\n")


def resolve_config_arguments(args: list[str]) -> list[str]:
    """LightningCLI arguments with each ``--config``/``-c`` recipe name replaced by its file's path, so that
    jsonargparse (which would read an unknown name as inline YAML) sees a file. Paths and inline YAML pass
    unchanged; a value that is neither a file nor a recipe raises :class:`FileNotFoundError`."""
    resolved = list(args)
    for i, arg in enumerate(resolved):
        flag, equals, value = arg.partition("=")
        if flag not in _CONFIG_FLAGS:
            continue
        if not equals:
            if i + 1 == len(resolved):
                continue  # jsonargparse reports the missing value
            value = resolved[i + 1]
        if _is_inline_yaml(value):
            continue
        path = str(recipe_file(value))
        if equals:
            resolved[i] = f"{flag}={path}"
        else:
            resolved[i + 1] = path
    return resolved
