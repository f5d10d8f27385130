"""A Ctrl-C while zarr reads ends quietly: zarr's pending reads are cancelled before zarr closes its event loop.

zarr 3 runs every read as asyncio tasks on an event loop in a thread of its own (``zarr.core.sync``: one
``concurrent_map`` task per chunk, decoded in a thread pool) and waits for them in the calling thread. A Ctrl-C
interrupts only that wait: the tasks go on, and at exit zarr's ``atexit`` hook (``cleanup_resources``) stops the
loop and closes it with the tasks still pending. Garbage collection then reports each one, 245 to 344 lines of
"Task was destroyed but it is pending!" and "RuntimeError: Event loop is closed" after fedfeat's one
``error: interrupted (Ctrl-C)`` line.

``install`` (called where fedfeat imports zarr, ``fedfeat.store.featurestore``) registers ``quiesce`` with
``atexit`` after zarr's hook, so that it runs first (``atexit`` runs hooks last registered, first run): on the
loop's own thread it cancels every pending task, waits (bounded) until they have finished unwinding, and routes
what the loop would still report on the way out to nothing. zarr's hook then finds an idle loop. A normal exit has
no pending task and nothing changes (``tests/test_env_hostile.py`` interrupts reads of a synthetic store).
"""

from __future__ import annotations

import asyncio
import atexit

_installed = False
TIMEOUT = 10.0  # seconds to wait for the cancelled reads to unwind (a chunk being decoded finishes first)


async def _cancel_pending(rounds: int = 20) -> int:
    """Cancel every task on the running loop but this one, and wait until they are done (a cancelled
    ``gather`` may wake others: repeated, at most ``rounds`` times). Returns how many were cancelled."""
    me, n = asyncio.current_task(), 0
    for _ in range(rounds):
        tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if not tasks:
            break
        for t in tasks:
            t.cancel()
        n += len(tasks)
        await asyncio.wait(tasks, timeout=TIMEOUT)
    return n


def quiesce(timeout: float = TIMEOUT) -> int:
    """Cancel zarr's pending reads on its loop and wait for them (at most ``timeout`` s); afterwards the loop
    reports nothing (its exception handler is a no-op: the process is exiting). Returns the number of tasks
    cancelled; 0 when zarr never started its loop."""
    import sys

    sync = sys.modules.get("zarr.core.sync")
    loop = getattr(sync, "loop", [None])[0] if sync is not None else None
    if loop is None or loop.is_closed() or not loop.is_running():
        return 0
    # "Task was destroyed but it is pending!" and the like: at exit, nothing to report
    loop.set_exception_handler(lambda _loop, _context: None)
    try:
        return asyncio.run_coroutine_threadsafe(_cancel_pending(), loop).result(timeout)
    except BaseException:  # noqa: BLE001 -- exiting: a loop that does not answer is left to zarr's own hook
        return 0


def install() -> None:
    """Register ``quiesce`` to run at exit before zarr's own clean-up (once per process)."""
    global _installed
    if _installed:
        return
    import zarr.core.sync  # noqa: F401  (its atexit hook is registered first, so ours runs before it)

    atexit.register(quiesce)
    _installed = True


__all__ = ["install", "quiesce"]
