"""Run directories on disk: safe names, one writer per name, atomic publication, unfinished runs.

Under ``OUT/`` a run named ``NAME`` goes through these paths:

* ``OUT/.lock-NAME``     created exclusively (``O_CREAT | O_EXCL``) by the process that writes the run, holding its
  pid, host and start time; a second process refuses naming the holder. A lock whose process is gone (same
  host, pid not running) is stale and taken over.
* ``OUT/.partial-NAME/`` the run while it is written: ``config.toml`` first, ``metrics.jsonl`` a row per round,
  ``checkpoint.safetensors`` every ``--checkpoint-every`` rounds. ``fedfeat train --resume OUT/NAME`` continues
  it; ``fedfeat report --all`` lists it as unfinished. Hidden: never read as a finished run.
* ``OUT/NAME/``          the finished run. The partial directory becomes it in one ``rename``; with ``--overwrite``
  the two are swapped atomically (``renameat2(RENAME_EXCHANGE)``; where a filesystem lacks it, the old run is
  first renamed to ``OUT/.old-NAME`` and restored by the next run of that name if a crash came in between),
  so the old run is there until the new one is complete.

Nothing outside ``OUT/NAME``, ``OUT/.partial-NAME``, ``OUT/.old-NAME`` and ``OUT/.lock-NAME`` is ever written
or deleted: a name is one path component (``check_name``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

from fedfeat.errors import FedfeatError

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
    """``--out`` must be a directory (created if missing)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FedfeatError(f"--out {out} is a file, not a directory; pass a directory for run directories")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FedfeatError(f"cannot create --out {out}: {e.strerror}; pass a writable directory") from None
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lock:
    """An exclusive lock file (pid, host, start time). ``acquire`` refuses while a live process holds it."""

    def __init__(self, path: Path, what: str):
        self.path, self.what, self.held = Path(path), what, False

    def acquire(self) -> Lock:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # being written by its creator this instant, or unreadable: look again
                    time.sleep(0.05)
                    holder = self._holder()
                if self._stale(holder):
                    self.path.unlink(missing_ok=True)
                    continue
                h = holder or {}
                raise FedfeatError(
                    f"{self.what} is being written by pid {h.get('pid', '?')} on host {h.get('host', '?')} since "
                    f"{h.get('since', '?')} (lock {self.path}); wait for it to finish, or delete the lock file if "
                    "that process is gone"
                ) from None
            except OSError as e:
                raise FedfeatError(
                    f"cannot create lock {self.path}: {e.strerror}; pass a writable --out"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise FedfeatError(f"could not take the lock {self.path}; try again")

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _stale(holder: dict | None) -> bool:
        """A lock of this host whose process is gone; another host's lock is never assumed stale."""
        if not holder or holder.get("host") != socket.gethostname():
            return False
        pid = holder.get("pid")
        return isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
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

    def recover(self) -> None:
        """Under the lock: finish what a crash between the two renames of the fallback publication left."""
        if self.old.exists():
            if self.final.exists():
                shutil.rmtree(self.old)
            else:
                os.rename(self.old, self.final)

    def publish(self, overwrite: bool) -> None:
        """Make the partial directory the finished run, atomically; the old run (``overwrite``) goes after."""
        if not self.final.exists():
            if not _renameat2(self.partial, self.final, _RENAME_NOREPLACE):
                os.rename(self.partial, self.final)
            return
        if not overwrite:  # checked at the start; a run that appeared meanwhile bypassed the lock
            raise FedfeatError(
                f"run directory {self.final} appeared while this run was written; pass --overwrite"
            )
        if _renameat2(self.partial, self.final, _RENAME_EXCHANGE):
            shutil.rmtree(self.partial)  # now the old run
            return
        os.rename(self.final, self.old)
        os.rename(self.partial, self.final)
        shutil.rmtree(self.old)


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
        raise Interrupted(signum)

    def __exit__(self, *exc):
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)
        return False


def fault_point(name: str) -> None:
    """Tests kill the process at a named point (``FEDFEAT_FAULT=name``): a real SIGKILL, no clean-up."""
    if os.environ.get("FEDFEAT_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


CHECKPOINT = "checkpoint.safetensors"  # a resumable run's state (fedfeat.engine.checkpoint)


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a row cut short by a kill: it and anything after it are redone
    return rows
