"""Run directories on disk: safe names, one writer per name, atomic publication, unfinished runs.

Under ``OUT/`` a run named ``NAME`` goes through these paths:

* ``OUT/.lock-NAME``     created atomically and exclusively (a fsynced temporary file hard-linked to the name:
  ``fedfeat.store.lock.write_lock_file``) by the process that writes the run, holding its pid, host and start
  time; a second process refuses naming the holder. A lock that is empty or unreadable, or whose process is
  gone (same host, pid not running), is stale and taken over with a message on stderr.
* ``OUT/.partial-NAME/`` the run while it is written: ``config.toml`` first, ``metrics.jsonl`` a row per round,
  ``checkpoint.safetensors`` every ``--checkpoint-every`` rounds. ``fedfeat train --resume OUT/NAME`` continues
  it; ``fedfeat report --all`` lists it as unfinished. Hidden: never read as a finished run.
* ``OUT/NAME/``          the finished run. The partial directory becomes it in one ``rename``; with ``--overwrite``
  the two are swapped atomically (``renameat2(RENAME_EXCHANGE)``; where a filesystem lacks it, the old run is
  first renamed to ``OUT/.old-NAME`` and restored by the next run of that name if a crash came in between),
  so the old run is there until the new one is complete.

Nothing outside ``OUT/NAME``, ``OUT/.partial-NAME``, ``OUT/.old-NAME`` and ``OUT/.lock-NAME`` is ever written
or deleted: a name is one path component (``check_name``), and none of these paths (nor an entry of
``.partial-NAME``) may be a symbolic link -- a run refuses one in a line before it writes anything and again at
publication (``RunDir.check_links``), so nothing follows a link out of ``OUT``. ``OUT`` itself may be a link (the
user named it), and it is local (``fedfeat.store.urls.local_path``: URLs are refused).

Interrupts: ``interrupt_latch`` remembers every SIGINT and raises again one that a library swallowed (numba's
compiler); ``check_interrupt`` stops before a summary is written; ``deferred_interrupts`` keeps publication's
renames whole.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

from fedfeat.errors import FedfeatError
from fedfeat.store.lock import acquire_lock_file, judge, lock_record, read_lock, release_lock_file

LOCK, PARTIAL, OLD = ".lock-", ".partial-", ".old-"
MAX_NAME = 200


def check_name(name) -> str:
    """A run name is one path component: not empty, no ``/`` or ``\\``, not ``.``/``..``, not hidden."""
    ok = isinstance(name, str) and name.strip() == name and 0 < len(name) <= MAX_NAME
    ok = ok and not any(c in name for c in "/\\\0") and name not in (".", "..") and not name.startswith(".")
    if not ok:
        raise FedfeatError(
            f"run name {name!r} is not a plain directory name (one path component: no '/', no '..', not "
            f"absolute, not empty, not starting with '.', at most {MAX_NAME} characters); pass another --name "
            "or leave it out for the default"
        )
    return name


def check_out(out: str | Path) -> Path:
    """``--out`` must be a local directory (created if missing): a URL is refused (``local_path``); ``--out``
    itself may be a symbolic link (the user named it), the entries under it may not (``RunDir.check_links``)."""
    from fedfeat.store.urls import local_path

    out = local_path(out, "--out", "a local directory for run directories")
    if out.exists() and not out.is_dir():
        raise FedfeatError(f"--out {out} is a file, not a directory; pass a directory for run directories")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FedfeatError(f"cannot create --out {out}: {e.strerror}; pass a writable directory") from None
    return out


class Lock:
    """An exclusive lock file (pid, host, start time), written atomically and judged by the rules of
    ``fedfeat.store.lock``: ``acquire`` takes over an empty, unreadable or dead (same host) holder's lock with a
    message (``log``, stderr by default) and refuses while a live process, or any process of another host, holds
    it."""

    def __init__(self, path: Path, what: str, log=None):
        self.path, self.what, self.log, self.held = Path(path), what, log, False
        self.record: dict | None = None

    def acquire(self) -> Lock:
        me = lock_record()
        acquire_lock_file(self.path, me, self._refuse, self.log, self._error)
        self.record, self.held = me, True
        return self

    def _refuse(self, h: dict) -> None:
        raise FedfeatError(
            f"{self.what} is being written by pid {h['pid']} on host {h['host']} since {h.get('since', '?')} "
            f"(lock {self.path}); wait for it to finish, or delete the lock file if that process is gone"
        ) from None

    def _error(self, e: OSError) -> FedfeatError:
        return FedfeatError(
            f"cannot create lock {self.path}: {e.strerror or e}; free space or pass a writable --out (no lock "
            "was left behind)"
        )

    def _holder(self) -> dict | None:
        return read_lock(self.path)[1]

    @staticmethod
    def _stale(holder: dict | None) -> bool:
        """A lock that ``acquire`` would take over (empty or unreadable, or of a gone process of this host)."""
        return judge(holder) is not None

    def release(self) -> None:
        if self.held:
            try:
                release_lock_file(self.path, self.record)
            except OSError:
                pass
            self.held = False


_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``; False where the C library or the filesystem lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


class RunDir:
    """The paths of run ``name`` under ``out`` (see the module docstring)."""

    def __init__(self, out: str | Path, name: str):
        self.out, self.name = Path(out), check_name(name)
        self.final = self.out / name
        self.partial = self.out / f"{PARTIAL}{name}"
        self.old = self.out / f"{OLD}{name}"
        self.lock = Lock(self.out / f"{LOCK}{name}", f"run {self.final}")

    def check_links(self, partial_contents: bool = True) -> None:
        """Refuse, in one line, when a path this run would write, delete, publish to or read back is a symbolic link
        (``NAME``, ``.partial-NAME``, ``.old-NAME``, ``.lock-NAME``, and each entry of ``.partial-NAME``: its
        checkpoint, metrics, config): a link would lead out of ``--out``. Nothing is changed here; the link
        itself is the user's to remove (its target is never touched). ``--out`` itself may be a link."""
        paths = [self.final, self.partial, self.old, self.lock.path]
        if partial_contents and self.partial.is_dir() and not self.partial.is_symlink():
            paths += sorted(self.partial.iterdir())
        for p in paths:
            if p.is_symlink():
                try:
                    to = f" (to {os.readlink(p)})"
                except OSError:
                    to = ""
                raise FedfeatError(
                    f"{p} is a symbolic link{to}; fedfeat never writes, publishes or deletes through a link "
                    f"out of --out: remove the link itself (its target stays as it is), or pass another --name "
                    "or --out"
                )

    def recover(self) -> None:
        """Under the lock: finish what a crash between the two renames of the fallback publication left."""
        self.check_links(partial_contents=False)
        if self.old.exists():
            if self.final.exists():
                shutil.rmtree(self.old)
            else:
                os.rename(self.old, self.final)

    def publish(self, overwrite: bool) -> None:
        """Make the partial directory the finished run, atomically; the old run (``overwrite``) goes after.
        A ``NAME`` that is a symbolic link is refused (``check_links``), never published through or deleted."""
        self.check_links(partial_contents=False)
        if not self.final.exists():
            if not _renameat2(self.partial, self.final, _RENAME_NOREPLACE):
                os.rename(self.partial, self.final)
            return
        if not overwrite:  # checked at the start; a run that appeared meanwhile bypassed the lock
            raise FedfeatError(
                f"run directory {self.final} appeared while this run was written; pass --overwrite"
            )
        if _renameat2(self.partial, self.final, _RENAME_EXCHANGE):
            if self.partial.is_symlink():  # a link made after the check above: the link goes, not its target
                os.unlink(self.partial)
            else:
                shutil.rmtree(self.partial)  # now the old run
            return
        os.rename(self.final, self.old)
        os.rename(self.partial, self.final)
        shutil.rmtree(self.old)


def take_unfinished(rd: RunDir, config_text: str, *, resumable: bool = True, log=None) -> bool:
    """Under the run's lock, when a sweep (``fedfeat sweep`` / ``reproduce`` run again after a kill) meets the
    unfinished run ``rd.partial`` of the run it is about to make, whose ``config.toml`` would read
    ``config_text``: True to go on from it -- it wrote its ``summary.json`` before the kill (it is published as it
    is) or a checkpoint (``resumable``: it is resumed from it, as ``fedfeat train --resume``, and checked as
    there) --, False once it is removed (nothing to go on from: a stacked run's share, no checkpoint yet, killed
    before its config was written; the run starts again). An unfinished run of other settings under this name
    (its ``config.toml`` is not this run's, nor a cut-short write of it) is refused in one line and left as it
    is."""
    if not rd.partial.is_dir():
        raise FedfeatError(
            f"{rd.partial} is not a directory; move it away (it is no run of fedfeat's), then run again"
        )
    if os.path.lexists(rd.partial / "config.toml"):
        try:
            text = read_regular(rd.partial / "config.toml")
        except FedfeatError:
            text = None
        if text is None or not config_text.startswith(text):  # a kill mid-write leaves a prefix of this run's
            raise FedfeatError(
                f"an unfinished run of other settings is in {rd.partial} (its config.toml is not this run's); "
                f"resume it alone with `fedfeat train --resume {rd.final}`, or move it away, then run again"
            )
        if text == config_text and (rd.partial / "summary.json").is_file():
            return True  # killed between its summary and the rename: finished, published as it is
        if text == config_text and resumable and (rd.partial / CHECKPOINT).is_file():
            return True
    if log is not None:
        log(f"{rd.name}: unfinished, no checkpoint to resume from: starting it again")
    shutil.rmtree(rd.partial)
    return False


class Interrupted(BaseException):
    """SIGTERM, turned into an exception so that clean-up code runs (SIGINT is ``KeyboardInterrupt``)."""


class sigterm_as_exception:
    """Context manager: SIGTERM raises ``Interrupted`` in the main thread while inside."""

    def __enter__(self):
        self.prev = None
        try:
            self.prev = signal.signal(signal.SIGTERM, self._raise)
        except ValueError:  # not the main thread: leave signals alone
            self.prev = None
        return self

    @staticmethod
    def _raise(signum, frame):
        _interrupt(Interrupted(signum), signum, frame)

    def __exit__(self, *exc):
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)
        return False


# ---------------------------------------------------------------------------------------- interrupts
# Ctrl-C must stop a command even where a library swallows the KeyboardInterrupt: numba's compiler (the fused
# kernels' first use) calls back into Python through ctypes, and an exception raised in such a callback is only
# printed ("Exception ignored on calling ctypes callback function") -- the compile, and the run, went on to rc 0.
_SEEN: list[BaseException] = []  # interrupts seen inside the outermost ``interrupt_latch``
_PENDING: list[BaseException] = []  # interrupts held back by ``deferred_interrupts``, raised at its end
_DEFERRING = [0]
_DEPTH = [0]  # interrupt_latch nesting
_HOOK: list = []  # the unraisable hook ``interrupt_latch`` replaced


def _redeliver(signum: int) -> None:
    """Deliver ``signum`` to the main thread again, a moment from now (from a helper thread)."""
    import threading

    t = threading.Timer(0.005, _deliver, (signum,))
    t.daemon = True
    t.start()


def _deliver(signum: int) -> None:
    import _thread

    if _DEPTH[0]:  # a command still runs under the latch (after it, the CLI has already seen the interrupt)
        _thread.interrupt_main(signum)


def _in_hook(frame) -> bool:
    while frame is not None:
        if frame.f_code is _unraisable.__code__:
            return True
        frame = frame.f_back
    return False


def _interrupt(exc: BaseException, signum: int, frame) -> None:
    if _in_hook(frame):  # inside ``_unraisable`` itself: raised there, it would be swallowed again
        _redeliver(signum)
        return
    _SEEN.append(exc)
    if _DEFERRING[0]:
        _PENDING.append(exc)
        return
    raise exc


def _on_sigint(signum, frame):
    _interrupt(KeyboardInterrupt(), signum, frame)


def _unraisable(u) -> None:
    """An interrupt a library swallowed is delivered again, from a helper thread, to the main thread's next Python
    line outside this hook; anything else goes to the usual hook."""
    if u.exc_type is not None and issubclass(u.exc_type, (KeyboardInterrupt, Interrupted)):
        _redeliver(signal.SIGTERM if issubclass(u.exc_type, Interrupted) else signal.SIGINT)
        return
    (_HOOK[-1] if _HOOK else sys.__unraisablehook__)(u)


class interrupt_latch:
    """Context manager (the CLI wraps every command in it; ``train`` wraps each run): SIGINT raises
    ``KeyboardInterrupt`` as usual and is also remembered, and an interrupt that a library swallowed is raised
    again (``_unraisable``); ``check_interrupt`` stops at the commit points (a run's summary, a store's complete
    flag) when one came. Only the outermost latch installs itself, and only where SIGINT has Python's default
    handler (a shell that started the process with SIGINT ignored keeps it ignored)."""

    def __enter__(self):
        self.prev = None
        if not _DEPTH[0]:  # the outermost: a fresh start
            _SEEN.clear()
            _PENDING.clear()
            try:
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    self.prev = signal.signal(signal.SIGINT, _on_sigint)
            except ValueError:  # not the main thread: leave signals alone
                self.prev = None
        _DEPTH[0] += 1
        if self.prev is not None:
            _HOOK.append(sys.unraisablehook)
            sys.unraisablehook = _unraisable
        return self

    def __exit__(self, *exc):
        _DEPTH[0] -= 1
        if self.prev is not None:
            signal.signal(signal.SIGINT, self.prev)
            sys.unraisablehook = _HOOK.pop()
        if not _DEPTH[0]:  # what came was raised or seen inside: nothing carries over to later calls
            _SEEN.clear()
            _PENDING.clear()
        return False


def interrupted() -> BaseException | None:
    """The first interrupt seen inside the current ``interrupt_latch`` (None: none)."""
    return _SEEN[0] if _SEEN else None


def check_interrupt() -> None:
    """Raise the interrupt (``KeyboardInterrupt`` or ``Interrupted``) that came, even if a library swallowed it:
    called before anything is marked complete."""
    if _SEEN:
        raise type(_SEEN[0])(*_SEEN[0].args)


class deferred_interrupts:
    """Context manager around a few renames that must not be cut in two (publishing a run): SIGINT / SIGTERM
    that come inside are raised at its end."""

    def __enter__(self):
        _DEFERRING[0] += 1
        return self

    def __exit__(self, *exc):
        _DEFERRING[0] -= 1
        if not _DEFERRING[0] and _PENDING:
            first = _PENDING[0]
            _PENDING.clear()
            if exc[0] is None:
                raise first
        return False


_FAULT_HITS: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Tests kill the process at a named point (``FEDFEAT_FAULT=name``, or ``name@K``: the K-th time this process
    reaches it, e.g. ``after-round-3@2`` in a sweep's second run): a real SIGKILL, no clean-up."""
    want = os.environ.get("FEDFEAT_FAULT")
    if not want:
        return
    point, _, k = want.partition("@")
    if point != name:
        return
    _FAULT_HITS[name] = _FAULT_HITS.get(name, 0) + 1
    if not k or str(_FAULT_HITS[name]) == k:
        os.kill(os.getpid(), signal.SIGKILL)


CHECKPOINT = "checkpoint.safetensors"  # a resumable run's state (fedfeat.engine.checkpoint)


def read_regular(path: str | Path) -> str:
    """The text of ``path`` if it is a regular file (symlinks followed). A FIFO, socket, device or directory is
    refused with a ``FedfeatError`` before it is opened (opening a FIFO would block for ever); the open itself is
    non-blocking and re-checked, in case the file was swapped meanwhile."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FedfeatError(f"{path} is {_kind(st.st_mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FedfeatError(f"{path} is missing") from None
    except OSError as e:
        raise FedfeatError(f"{path} is unreadable ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FedfeatError(f"{path} is {_kind(st.st_mode)}, not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    except OSError as e:
        raise FedfeatError(f"{path} is unreadable ({e.strerror or e})") from None
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FedfeatError(f"{path} is not UTF-8 text (byte {e.start})") from None


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return what
    return "not a file"


def read_metrics(path: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` up to the first that is not a JSON object (a row cut short by a kill:
    it and anything after it are redone). A ``FedfeatError`` if it is not a readable regular file."""
    rows = []
    for line in read_regular(path).splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break  # a row cut short by a kill: it and anything after it are redone
        if not isinstance(row, dict):
            break
        rows.append(row)
    return rows
