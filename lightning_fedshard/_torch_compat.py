"""The private torch names the verifier relies on, and :func:`require_extra`: the part of
:mod:`lightning_fedshard.compat` that needs no Lightning.

``fedshard verify`` imports only torch, onnx and numpy (VNN-COMP counts start-up inside the timeout), so the checks
it needs live here; :mod:`lightning_fedshard.compat` re-exports them next to the Lightning checks.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

__all__ = ["SUPPORTED_VERSIONS", "TorchDispatchMode", "private", "require_extra", "tree_leaves", "unsupported"]

#: What the package is built and tested against (pyproject.toml's ``dependencies`` say the same).
SUPPORTED_VERSIONS = "torch>=2.9 (tested with 2.13) and lightning>=2.6,<2.7"

_DISTRIBUTION = "lightning-fedshard"


def unsupported(what: str, installed: str | None = None) -> ImportError:
    """The error for a missing private name: what is missing, the installed versions, the supported ones."""
    installed = installed or f"torch {torch.__version__}"
    return ImportError(
        f"lightning_fedshard relies on {what}, which the installed {installed} does not have. lightning_fedshard"
        f" supports {SUPPORTED_VERSIONS}; install a torch and lightning in that range."
    )


def private(module: str, name: str, installed: str | None = None) -> Any:
    """``module.name``, or an ImportError naming it and the supported versions."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise unsupported(f"the private `{module}.{name}`", installed) from None


def require_extra(module: str, extra: str, feature: str) -> ModuleType:
    """The optional dependency ``module``, imported; an ImportError naming the extra that installs it otherwise.

    ``feature`` says what needs it, e.g. ``"fault-tolerant federation groups (fault_tolerance=...)"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{feature} needs `{module}`, which is not installed ({err}). Install it with"
            f" `pip install '{_DISTRIBUTION}[{extra}]'` (or `pip install -e '.[{extra}]'` in a checkout)."
        ) from err


# The verifier's memory accounting.
TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode")
tree_leaves = private("torch.utils._pytree", "tree_leaves")
