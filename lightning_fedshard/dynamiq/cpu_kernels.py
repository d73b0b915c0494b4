"""DynamiQ's CPU kernels (``cpu_kernels.c``), loaded through ``ctypes`` and called on the tensors' memory. They
give the bytes of the torch functions in ``dynamiq_format`` and ``dynamiq_codec`` (the reference, and the
fallback where the kernels are missing or ``FEDSHARD_DYNAMIQ_COMPILE=0``).

Which library runs (``origin()`` says, and a warning says so whenever it is not the first):

1. **prebuilt**: built by ``setup.py`` at install, one per x86-64 level, the best one this CPU runs;
2. **compiled** at run time with ``-march=native`` into a private per-user cache (``$FEDSHARD_CACHE_DIR``,
   default ``~/.cache/lightning_fedshard``) where none was installed, once per node under a file lock;
3. **torch**, where neither loads (no compiler, an unsafe cache directory, a failed build).

``cpu_kernels_build`` has the details (flags, levels, the cache's checks).

Example::

    from lightning_fedshard.dynamiq import cpu_kernels

    if cpu_kernels.library() is not None:
        maxima = cpu_kernels.group_max(x)               # x: fp32 CPU, numel a multiple of 256
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lightning_fedshard.dynamiq import cpu_kernels_build

__all__ = ["Origin", "decode_into", "encode", "group_max", "library", "origin"]

_PREBUILT_DIR = Path(__file__).parent  # where setup.py's extensions land, in a wheel and in an editable install
_TUNINGS = cpu_kernels_build.native_tunings(platform.machine())  # run-time compiling's flags, best first
_GROUP, _GROUPS_PER_SG, _SIDE_BYTES_PER_SG = 32, 8, 15
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "dq_group_max": ((_P, _I64, _P), None),
    "dq_encode": ((_P, _P, _I64, _I64, _P, _P, _INT, _I64, _INT, _P, _P, _P), None),
    "dq_decode": ((_P, _I64, _I64, _P, _INT, _P, _P, _P), _INT),
}


class Origin(NamedTuple):
    """Which kernels run: ``"prebuilt"`` (built at install), ``"compiled"`` (at run time, cached), or
    ``"torch"`` (none: the torch functions); ``path`` is the library's file."""

    kind: Literal["prebuilt", "compiled", "torch"]
    path: Path | None = None
    lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` where they are turned off or cannot be loaded (then a warning, once)."""
    return origin().lib


def origin() -> Origin:
    """Where the kernels come from (loaded on the first call, with a warning unless prebuilt)."""
    setting = os.environ.get("FEDSHARD_DYNAMIQ_COMPILE", "auto").lower()
    return Origin("torch") if setting in ("0", "off", "false", "no") else _load()


@functools.cache
def _load() -> Origin:
    try:
        found = cpu_kernels_build.load_prebuilt(_PREBUILT_DIR)
        missing = f"no prebuilt CPU kernels in {_PREBUILT_DIR} (install the package with a C compiler)"
    except OSError as error:
        found, missing = None, f"the prebuilt CPU kernels do not load ({error})"
    if found is not None:
        return _bound(Origin("prebuilt", found[1], found[0]))
    compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if compiler is None:
        warnings.warn(f"DynamiQ: {missing} and no C compiler; using torch (slower).", stacklevel=4)
        return Origin("torch")
    try:
        lib, path = cpu_kernels_build.compile_cached(compiler, _TUNINGS)
    except PermissionError as error:
        warnings.warn(f"DynamiQ: {missing}; {error}; using torch (slower).", stacklevel=4)
        return Origin("torch")
    except (OSError, subprocess.SubprocessError) as error:
        warnings.warn(f"DynamiQ: {missing}, and compiling them failed: {error}; using torch (slower).", stacklevel=4)
        return Origin("torch")
    warnings.warn(f"DynamiQ: {missing}; using {path}, compiled at run time with {compiler}.", stacklevel=4)
    return _bound(Origin("compiled", path, lib))


def _bound(found: Origin) -> Origin:
    for name, (arguments, result) in _SIGNATURES.items():
        function = getattr(found.lib, name)
        function.argtypes, function.restype = arguments, result
    return found


def _address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The kernels trust every length they are given: the wrappers below check each one before the call, so that a wrong
# size raises here instead of reading or writing past a tensor's memory.
_SUPER_GROUP = _GROUP * _GROUPS_PER_SG
#: Entries of the scale table (indexed by a byte) and of the mantissa thresholds that the kernels read.
_TABLE_SIZE, _MANTISSA_STEPS = 256, 7


def _check(x: Tensor, dtype: torch.dtype, what: str, numel: int | None = None) -> None:
    if x.device.type != "cpu" or x.dtype != dtype or not x.is_contiguous():
        raise ValueError(
            f"DynamiQ CPU kernels: {what} must be a contiguous {dtype} CPU tensor, got {x.dtype} on {x.device}"
        )
    if numel is not None and x.numel() != numel:
        raise ValueError(f"DynamiQ CPU kernels: {what} has {x.numel()} elements, expected {numel}")


def _groups(x: Tensor, unit: int, what: str) -> int:
    """Groups of 32 in ``x``, whose size must be a whole number of ``unit`` coordinates (the kernels drop a
    remainder or, for messages, misplace every field after it)."""
    if x.numel() % unit:
        raise ValueError(
            f"DynamiQ CPU kernels: {what} has {x.numel()} coordinates, not a multiple of {unit} "
            "(DynamiQCodec pads tensors to whole super-groups of 256 before calling them)"
        )
    return x.numel() // _GROUP


def _check_budget(budget: int) -> None:
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"DynamiQ CPU kernels: the payload budget is a non-negative int, got {budget!r}")


def _message_bytes(groups: int, budget: int) -> int:
    """Bytes of the message of ``groups`` groups of 32 (whole super-groups) at ``budget`` payload words."""
    return groups // _GROUPS_PER_SG * _SIDE_BYTES_PER_SG + 4 * budget


def _kernels() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(
            "DynamiQ CPU kernels are turned off (FEDSHARD_DYNAMIQ_COMPILE) or did not build; DynamiQCodec runs "
            "the torch functions then."
        )
    return lib


def group_max(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Max |x| of each group of 32 of fp32 ``x`` (a NaN wins, as in ``torch.amax``), into ``out`` (one element
    per group) when given."""
    _check(x, torch.float32, "x")
    groups = _groups(x, _GROUP, "x")
    out = torch.empty(groups, dtype=torch.float32) if out is None else out
    _check(out, torch.float32, "out", groups)
    _kernels().dq_group_max(x.data_ptr(), groups, out.data_ptr())
    return out


def encode(
    x: Tensor,
    maxima: Tensor,
    budget: int,
    table: Tensor,
    mantissa_steps: Tensor,
    key: int | None,
    antithetic: bool,
    scratch: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The message of fp32 ``x`` (a multiple of 256 coordinates) whose group maxima are ``maxima``, spending
    ``budget`` payload width units; ``key`` is the stochastic-rounding dither's (``None``: to nearest), a
    non-negative int64. ``scratch``: an int32 and an int64 tensor of at least one element per group, reused
    across calls (fresh ones otherwise)."""
    _check(x, torch.float32, "x")
    groups = _groups(x, _SUPER_GROUP, "x")
    _check(maxima, torch.float32, "group maxima", groups)
    _check(table, torch.float32, "scale table", _TABLE_SIZE)
    _check(mantissa_steps, torch.float32, "mantissa steps", _MANTISSA_STEPS)
    _check_budget(budget)
    if key is not None and not (isinstance(key, int) and 0 <= key < 1 << 63):
        raise ValueError(f"DynamiQ CPU kernels: the dither key is a non-negative int64, got {key!r}")
    widths, keys = scratch or (torch.empty(groups, dtype=torch.int32), torch.empty(groups, dtype=torch.int64))
    _check(widths, torch.int32, "width scratch")
    _check(keys, torch.int64, "key scratch")
    if widths.numel() < groups or keys.numel() < groups:
        raise ValueError(f"DynamiQ CPU kernels: scratch of {widths.numel()}, {keys.numel()} for {groups} groups")
    msg = torch.empty(_message_bytes(groups, budget), dtype=torch.uint8)
    _kernels().dq_encode(
        x.data_ptr(), maxima.data_ptr(), groups, budget, table.data_ptr(), mantissa_steps.data_ptr(),
        int(key is not None), 0 if key is None else key, int(antithetic),
        msg.data_ptr(), widths.data_ptr(), keys.data_ptr(),
    )  # fmt: skip
    return msg


def decode_into(
    msg: Tensor,
    budget: int,
    table: Tensor,
    stochastic: bool,
    local: Tensor | None,
    out: Tensor,
    maxima: Tensor | None = None,
) -> Tensor:
    """Writes ``decode(msg) (+ local)`` into fp32 ``out`` (a multiple of 256 coordinates) and its group maxima
    into ``maxima`` (fresh if not given), which it returns. ``msg`` must have the size of ``out.numel()``
    coordinates at ``budget``; a message whose widths ask for more payload than that is rejected."""
    _check(out, torch.float32, "out")
    groups = _groups(out, _SUPER_GROUP, "out")
    _check_budget(budget)
    _check(msg, torch.uint8, "message")
    expected = _message_bytes(groups, budget)
    if msg.numel() != expected:
        raise ValueError(
            f"DynamiQ message of {msg.numel()} bytes; {out.numel()} coordinates at {budget} width units need "
            f"{expected}."
        )
    _check(table, torch.float32, "scale table", _TABLE_SIZE)
    if local is not None:
        _check(local, torch.float32, "local", out.numel())
    maxima = torch.empty(groups, dtype=torch.float32) if maxima is None else maxima
    _check(maxima, torch.float32, "maxima", groups)
    status = _kernels().dq_decode(
        msg.data_ptr(), groups, budget, table.data_ptr(), int(stochastic), _address(local),
        out.data_ptr(), maxima.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"DynamiQ message is corrupt: its group widths need more than its {budget} payload words.")
    return maxima
