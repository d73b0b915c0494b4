"""Row chunks for element-wise work on coefficients: temporaries the size of all rows are slow to allocate.

A temporary of tens of MB is a fresh ``mmap`` on every allocation (glibc hands blocks above 32 MB straight back to
the system), and its page faults cost 5-10x the arithmetic: on cifar_biasfield's windows (11.5 M floats) a product
took 47 ms into a new tensor and 6 ms into an existing one, a float64 sum 78 ms at once and 14-17 ms in chunks of
8-512 rows (the same within 25 % over that range). Chunks of about :data:`CHUNK_BYTES` stay in the cache and in
malloc's heap.

Example::

    parts = [(A[rows] * value).sum(-1, dtype=torch.float64) for rows in row_chunks(A.shape[0], 8 * A[0].numel())]
"""

from __future__ import annotations

__all__ = ["CHUNK_BYTES", "WHOLE_BYTES", "row_chunks"]

CHUNK_BYTES = 1 << 21
#: Temporaries up to this size are made whole: :func:`~lightning_fedshard.verify.heap.keep_freed_memory` keeps
#: blocks below 32 MiB in the heap, so they reuse pages, and chunks of small work only add operations (ACAS Xu's
#: input splitting, ``[rows, 2,000 boxes, 50]``, ran 10 % slower cut into rows).
WHOLE_BYTES = 16 * CHUNK_BYTES


def row_chunks(rows: int, bytes_per_row: int) -> list[slice]:
    """Slices covering ``range(rows)`` whose temporaries of ``bytes_per_row`` per row hold about
    :data:`CHUNK_BYTES` each (at least one row) — or one slice of all rows where they hold at most
    :data:`WHOLE_BYTES` together (also for no rows, so that a concatenation of the parts keeps its shape)."""
    if rows * bytes_per_row <= WHOLE_BYTES:
        return [slice(0, rows)]
    step = max(1, CHUNK_BYTES // max(1, bytes_per_row))
    return [slice(first, first + step) for first in range(0, rows, step)]
