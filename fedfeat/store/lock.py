"""``StoreLock``: one writer per store (``STORE.lock``, created exclusively, holding pid, host and start time).
A lock whose holder is dead on this host is stale and taken over; on an object store the lock is advisory (one PUT
per chunk, ``complete`` last is what makes a crash safe there).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

from fedfeat.errors import FedfeatError
from fedfeat.store.urls import storage_error, store_location, url_filesystem


# ---------------------------------------------------------------------------------------- writer lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class StoreLock:
    """One writer per store: ``STORE.lock`` beside the store, created with ``O_CREAT | O_EXCL`` and holding
    the writer's pid, host and start time (beside it, not inside: ``--force`` deletes the store directory).

    A lock whose holder is on this host and no longer running is stale and is taken over (with a message);
    a live holder, or one on another host (whose pid cannot be checked from here), is refused with a message
    naming it and how to remove a stale lock. Use as a context manager; ``release`` removes only our own lock.

    A store at a URL (``memory://``, ``s3://``...) gets ``URL.lock`` the same way, but object stores have no
    exclusive create: the lock is written and then read back, which catches a holder that started earlier, not
    one that starts in the same instant (advisory: run one encode per store URL).

    Example::

        >>> with StoreLock("cache/cifar10/RN50-openai.zarr", log=print):
        ...     pass   # create, resume or rebuild the store
    """

    def __init__(self, store: str | Path, *, command: str = "fedfeat encode", log=None):
        self.store = store_location(store)
        self.path: Path | str = (
            self.store.with_name(self.store.name + ".lock")
            if isinstance(self.store, Path)
            else self.store + ".lock"
        )
        self.command = command
        self.log = log or (lambda msg: None)
        self.token: dict | None = None

    def _holder(self) -> dict | None:
        try:
            if isinstance(self.path, Path):
                raw = self.path.read_text()
            else:
                fs, p = url_filesystem(self.path)
                raw = fs.cat_file(p)
            doc = json.loads(raw)
            return doc if isinstance(doc, dict) else None
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None

    def _stale_or_refuse(self, holder: dict | None, host: str) -> None:
        """Return when ``holder`` (read from an existing lock) is a dead process on this host; else refuse."""
        if holder is None or "pid" not in holder:
            raise FedfeatError(
                f"{self.store} is locked ({self.path} exists but is unreadable); if no "
                f"`{self.command}` is writing this store, remove {self.path}"
            ) from None
        pid, where = int(holder["pid"]), holder.get("host", "?")
        if where == host and not _pid_alive(pid):
            self.log(
                f"taking over the stale lock {self.path} (pid {pid} on {where} since "
                f"{holder.get('since', '?')} is no longer running)"
            )
            return
        raise FedfeatError(
            f"{self.store} is being written by another `{holder.get('command', self.command)}` "
            f"(pid {pid} on host {where}, since {holder.get('since', '?')}); wait for it to finish. "
            f"If that process is gone (a crash on another host), remove {self.path} and re-run"
        ) from None

    def acquire(self) -> StoreLock:
        host = socket.gethostname()
        me = {
            "pid": os.getpid(),
            "host": host,
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": self.command,
        }
        if not isinstance(self.path, Path):
            return self._acquire_url(me, host)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    holder = self._holder()
                    if holder == {}:  # released between our open and our read: try again
                        continue
                    self._stale_or_refuse(holder, host)
                    stale = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
                    try:
                        os.rename(self.path, stale)  # only one of several contenders wins this
                        stale.unlink()
                    except FileNotFoundError:
                        pass
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                    f.flush()
                    os.fsync(f.fileno())
                self.token = me
                return self
        except OSError as e:
            raise storage_error(e, self.path, "locking the store") from None
        raise FedfeatError(f"could not take the lock {self.path} (contended); re-run the command")

    def _acquire_url(self, me: dict, host: str) -> StoreLock:
        fs, p = url_filesystem(str(self.path))
        try:
            for _ in range(3):
                holder = self._holder()
                if holder != {}:
                    self._stale_or_refuse(holder, host)
                    fs.rm_file(p)
                fs.pipe_file(p, json.dumps(me).encode())
                if self._holder() == me:  # last writer wins on an object store: check that it is us
                    self.token = me
                    return self
        except OSError as e:
            raise storage_error(e, self.path, "locking the store") from None
        raise FedfeatError(f"could not take the lock {self.path} (contended); re-run the command")

    def release(self) -> None:
        if self.token is None:
            return
        if self._holder() == self.token:
            try:
                if isinstance(self.path, Path):
                    self.path.unlink()
                else:
                    fs, p = url_filesystem(self.path)
                    fs.rm_file(p)
            except OSError:
                pass
        self.token = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
