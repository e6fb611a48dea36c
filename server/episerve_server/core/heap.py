"""Giving the heap's free memory back to the system after a burst.

The daemon serves blocks up to 4 MiB from glibc's heap (``rpc/process/server.tune_allocator``), so
a response's buffers are reused by the next batch instead of being faulted in again. After a
burst of held responses (a slow or stuck client made the daemon keep up to
``--max-buffered-bytes`` of them), that memory would stay with the process; ``trim_soon``
returns the heap's free pages (``malloc_trim``) in a worker thread, once per burst.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
from collections.abc import Callable

_lock = threading.Lock()
_running = False


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc
    return trim


_TRIM = _malloc_trim()
trims = 0  # how many have run in this process


def trim() -> None:
    """Return the heap's free pages to the system now (glibc; elsewhere nothing)."""
    global _running, trims
    try:
        if _TRIM is not None:
            _TRIM(0)
            trims += 1
    finally:
        with _lock:
            _running = False


def trim_soon() -> None:
    """``trim`` in a worker thread (ctypes lets the event loop run meanwhile); one at a
    time, a call while one runs is dropped."""
    global _running
    with _lock:
        if _running or _TRIM is None:
            return
        _running = True
    try:
        asyncio.get_running_loop().run_in_executor(None, trim)
    except RuntimeError:  # no loop here: trim inline
        trim()
