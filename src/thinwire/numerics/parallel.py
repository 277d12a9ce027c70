"""CPU passes split across threads: NumPy lets go of the GIL inside its loops, so parts of
one pass over a large array run side by side on a pool of threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

_pool_lock = threading.Lock()
_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, workers) -> pool


def split(fn: Callable[[int, int], object], n: int, chunk: int, min_size: int) -> list:
    """``fn(a, b)`` over consecutive parts of ``[0, n)``, each starting at a multiple of
    ``chunk``: one part below ``min_size``, else one per torch thread (parts of at least
    ``min_size / 2``), the first run here, the others on a pool of threads. Results in
    order; every part has finished when it returns, also when one raised."""
    workers = min(torch.get_num_threads(), n // (min_size // 2))
    if workers < 2 or n < min_size:
        return [fn(0, n)]
    step = -(-n // workers // chunk) * chunk  # ceil, in whole chunks
    spans = [(a, min(n, a + step)) for a in range(0, n, step)]
    pool = threads(torch.get_num_threads() - 1)
    futures = [pool.submit(fn, a, b) for a, b in spans[1:]]
    try:
        first = fn(*spans[0])
    finally:
        wait(futures)
    return [first] + [f.result() for f in futures]


def threads(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads for this process (one per process: a forked child has
    none of its parent's threads) and thread count (pools for other counts stay, idle)."""
    key = (os.getpid(), workers)
    with _pool_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(workers, thread_name_prefix="thinwire-pass")
        return pool
