"""A pass over a rollout dump chunk by chunk (``rollcorr analyze``, ``rollcorr audit --from-log``; the chunks come
from ``rollcorr.dumps.DumpReader.chunks``): torch on one thread, the allocator's free pages handed back every few
chunks, and exact quantiles of the values kept across chunks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch


def release_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing). Without it
    the chunks' freed (B, T) buffers stay in the process heap, and peak RSS crept up with the dump's size
    (measured: +180 MB over 10^7 tokens); with it, it stays flat."""
    trim = _LIBC.get("trim")
    if trim is None and "trim" not in _LIBC:
        try:
            import ctypes

            trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            trim = None
        _LIBC["trim"] = trim
    if trim is not None:
        trim(0)


_LIBC: dict = {}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while inside: a chunk's passes are too small to share out (and on a loaded machine a
    second OpenMP thread waiting for a busy core made them ~100× slower, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def quantiles(x: np.ndarray, qs: Sequence[float] = (0.05, 0.5, 0.95)) -> tuple[float, ...]:
    """``torch.quantile``'s linear interpolation (same rank and lerp formulas, float64) by selection, with no
    size limit (torch.quantile refuses more than 2^24 values)."""
    x = np.asarray(x, np.float64)
    n = len(x)
    if n == 0:
        return tuple(math.nan for _ in qs)
    ranks = np.asarray(qs, np.float64) * (n - 1)
    below, above = np.floor(ranks).astype(np.int64), np.ceil(ranks).astype(np.int64)
    part = np.partition(x, np.unique(np.concatenate([below, above])))
    lo, hi, w = part[below], part[above], ranks - below
    out = np.where(w < 0.5, lo + w * (hi - lo), hi - (hi - lo) * (1 - w))  # torch.lerp
    return tuple(float(v) for v in out)
