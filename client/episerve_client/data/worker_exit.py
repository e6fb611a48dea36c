"""A spawned DataLoader worker that exits cleanly, never with ``terminate called ...``.

Each worker hands its batches to the main process through a ``multiprocessing`` queue
whose feeder thread pickles them. For a torch tensor that means moving its storage into
shared memory, in C++ with the GIL released. When the loader is dropped mid-epoch the
worker's loop returns at once (torch stops waiting for that thread on purpose), and a
*spawned* worker then runs the full interpreter shutdown: a thread that asks for the GIL
back after shutdown began is ended by ``pthread_exit``, whose unwinding through that C++
frame calls ``std::terminate``, and the worker dies of SIGABRT. (Fork and forkserver
workers leave through ``os._exit`` and never get there.) Waiting for the feeder before
shutdown begins, in an ``atexit`` hook, closes the window.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

#: Seconds a worker's exit waits, at most, for its queue feeders to finish their batch: the
#: main process gives a worker 5 s to end before it terminates it.
FEEDER_WAIT_S = 2.0
#: The name ``multiprocessing.Queue`` gives its feeder thread.
FEEDER_NAME = "QueueFeederThread"
_registered_pid = 0


def settle_feeders_at_exit() -> None:
    """In a DataLoader worker: have its exit wait for its queue feeders (once per process)."""
    global _registered_pid
    if _registered_pid != os.getpid():
        _registered_pid = os.getpid()
        atexit.register(join_feeders)


def join_feeders(wait_s: float = FEEDER_WAIT_S) -> int:
    """Join this process's live queue feeder threads, ``wait_s`` in all at most; returns
    how many were still running when called."""
    deadline = time.monotonic() + wait_s
    running = [t for t in threading.enumerate()
               if t.daemon and t.name == FEEDER_NAME and t.is_alive()
               and t is not threading.current_thread()]
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    return len(running)
