"""The C heap of a verification process: freed tensor memory kept for the next allocation.

Torch allocates CPU tensors with the C library's ``malloc``. glibc returns memory to the OS eagerly: a block above its
mmap threshold (128 KiB at first, raised adaptively) gets pages of its own that ``free`` unmaps, and a free area of
more than the trim threshold at the top of the heap is released. A bound pass allocates and frees the same
megabyte-sized temporaries thousands of times per second (coefficients ``[S, B, *shape]`` of every operator step), so
every one of them came back as fresh pages, each zero-filled on its first touch by a page fault in the kernel (on
ACAS Xu's input splitting 150 faults per box bounded: 2_8/φ1 spent 1.8 s of its 8.2 s of CPU in the kernel, and
a virtual machine pays the host's faults in wall time besides). :func:`keep_freed_memory` raises both thresholds once per process: blocks up to 32 MiB come from the heap
and the heap keeps up to 64 MiB free, so the temporaries of one pass reuse the pages of the last.

Example::

    keep_freed_memory()   # at the start of a process that verifies (``fedshard verify`` does)
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

#: Blocks up to this size come from the heap (glibc's largest allowed mmap threshold on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: The heap releases memory to the OS only above this much free space at its top.
TRIM_THRESHOLD = 64 << 20
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse (see the module docs); whether it could (``False`` on a
    C library without ``mallopt``: musl, macOS, Windows).

    A process-wide setting, for processes that verify: the resident set then stays near the high-water mark of the
    passes (at most :data:`TRIM_THRESHOLD` above what is live, blocks of more than :data:`MMAP_THRESHOLD` still go
    back when freed), which the memory budget counts as held (:class:`~lightning_fedshard.verify.budget.Budget`).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Setting either threshold also ends glibc's adaptive raising of both: they stay as set.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
