"""numba's on-disk cache of fedfeat's compiled functions, kept from breaking a run (``cached``).

numba keeps a cached function's machine code as an index file ``FILE.FUNC-LINE.pyXY.nbi`` and data files
``FILE.FUNC-LINE.pyXY.N.nbc`` in one folder (``NUMBA_CACHE_DIR``, else the ``__pycache__`` next to the source when
it is writable, else the per-user cache), and unpickles them unguarded: random bytes in either (a disk error, a
copy interrupted half-way, another tool's files) raise from the function's first call -- in ``fedfeat compile``
and in every ``train`` that runs the fused kernels -- and the save after a compile reads the index again, so a
compile does not repair it either.

``cached(**options)`` is ``numba.njit(cache=True, **options)`` with numba's cache object wrapped in
``GuardedCache``:

* an entry that does not load (whatever numba raises reading or rebuilding it) is deleted -- that function's
  index and data files, nothing else -- and the function compiles again and is cached afresh, with one warning
  line on stderr per process;
* an entry that cannot be deleted, a cache folder that cannot be written, or the same function failing to load a
  second time: that function's cache is off in this process (it compiles in memory, as without ``cache=True``),
  with one warning line;
* no folder numba can cache in at all (each of them read-only): every function compiles in memory, one warning
  line.

A ``KeyboardInterrupt`` is never caught. ``tests/test_env_hostile.py`` plants the garbage.
"""

from __future__ import annotations

import os
import sys

import numba as nb

_warned: set[str] = set()  # the kinds of warning printed in this process (one line each)


def _warn(kind: str, msg: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        print(f"warning: {msg}", file=sys.stderr)


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def entries(folder: str | os.PathLike, base: str) -> list[str]:
    """The cache files of one function in ``folder``: its index ``BASE.nbi`` and data files ``BASE.N.nbc``
    (numba's names; ``base`` is ``FILE.FUNC-LINE.pyXY``), sorted. A missing folder has none."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for n in names:
        number = n[len(base) + 1 : -4] if n.startswith(base + ".") and n.endswith(".nbc") else ""
        if n == base + ".nbi" or number.isdigit():
            out.append(os.path.join(folder, n))
    return sorted(out)


def remove_entries(folder: str | os.PathLike, base: str) -> list[str]:
    """Delete one function's cache files (``entries``); returns the paths deleted. One that cannot be deleted
    (a read-only folder, a directory in a file's place) raises its ``OSError``; one already gone is skipped
    (another process rebuilding the same cache)."""
    removed = []
    for p in entries(folder, base):
        try:
            os.unlink(p)
        except FileNotFoundError:
            continue
        removed.append(p)
    return removed


class GuardedCache:
    """numba's cache of one function (``numba.core.caching.FunctionCache``), loads and saves guarded (module
    docstring); everything else is the wrapped cache's."""

    def __init__(self, inner, name: str):
        self._inner = inner
        self._name = name
        self._rebuilt = False

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    @property
    def folder(self) -> str:
        return self._inner._cache_path

    @property
    def base(self) -> str:
        return self._inner._impl.filename_base

    def load_overload(self, sig, target_context):
        try:
            return self._inner.load_overload(sig, target_context)
        except Exception as e:  # noqa: BLE001 -- any unreadable entry: numba compiles instead
            self._unreadable(e)
            return None

    def save_overload(self, sig, data) -> None:
        try:
            self._inner.save_overload(sig, data)
        except Exception as e:  # noqa: BLE001 -- the compiled code is in memory already; only the cache is lost
            self._off(
                f"numba cannot write its cache of fedfeat's compiled kernels in {self.folder} ({_why(e)})"
            )

    def _unreadable(self, e: Exception) -> None:
        if self._rebuilt:  # deleted once and unreadable again (another process writing there?): in memory
            self._off(f"numba's cache of {self._name} in {self.folder} is unreadable again ({_why(e)})")
            return
        self._rebuilt = True
        try:
            remove_entries(self.folder, self.base)
        except OSError as e2:
            self._off(
                f"numba's cache of {self._name} in {self.folder} is unreadable ({_why(e)}) and cannot be deleted "
                f"({_why(e2)})"
            )
            return
        _warn(
            "rebuilt",
            f"numba's cache of fedfeat's compiled kernels in {self.folder} is unreadable ({_why(e)}); its entries "
            "are deleted and compiled again (once, ~25 s)",
        )

    def _off(self, msg: str) -> None:
        self._inner.disable()  # loads and saves do nothing: the function compiles in memory
        _warn(
            "off",
            f"{msg}; compiling in memory for this process (set NUMBA_CACHE_DIR to a writable folder to keep "
            "the compiled code)",
        )


def guard(dispatcher):
    """Turn on numba's disk cache of ``dispatcher`` (``cache=True``), guarded (module docstring); returns it."""
    if not hasattr(dispatcher, "enable_caching"):  # NUMBA_DISABLE_JIT: a plain Python function
        return dispatcher
    name = dispatcher.py_func.__qualname__
    try:
        dispatcher.enable_caching()
    except Exception as e:  # noqa: BLE001 -- RuntimeError: no folder numba can write its cache in
        _warn(
            "off",
            f"numba has no writable folder to cache fedfeat's compiled kernels in ({_why(e)}); compiling in "
            "memory for this process (set NUMBA_CACHE_DIR to a writable folder to keep the compiled code)",
        )
        return dispatcher
    dispatcher._cache = GuardedCache(dispatcher._cache, name)
    return dispatcher


def cached(**options):
    """``numba.njit(cache=True, **options)``, its disk cache guarded (module docstring)."""

    def deco(func):
        return guard(nb.njit(**options)(func))

    return deco


__all__ = ["GuardedCache", "cached", "entries", "guard", "remove_entries"]
