"""Lock files: one writer per store (``StoreLock``: ``STORE.lock``) and per run directory (``fedfeat.report.rundir``
``Lock``: ``OUT/.lock-NAME``), with the same rules for both (``write_lock_file``, ``read_lock``, ``judge``,
``take_over``).

A lock records the writer's pid, host, start time, and on Linux the machine's boot id and the process's start
ticks (``/proc/PID/stat``), and is written atomically: a temporary file beside it is written and fsynced, then
hard-linked to the lock's name (``link`` fails if the name exists: the exclusive create). A full disk therefore
never leaves a 0-byte lock that looks held: the temporary file is removed and nothing else was created.

An existing lock is judged (``judge``):

* empty, unreadable or not a lock record (a writer killed while creating it by an older fedfeat, a damaged
  file): stale, taken over with a message;
* this host, and its process gone (dead pid; the pid now another process, by its start ticks; written before the
  machine restarted, by its boot id): stale, taken over with a message;
* a live process of this host, or any lock of another host (whose processes cannot be checked from here):
  held; the command is refused naming the holder.

Taking over removes the stale lock under an exclusive ``flock`` of its directory (never stale: the kernel
drops it with its process) after checking that it still holds the bytes judged stale, so that of several processes
taking over one stale lock one wins; the others look again and find the winner's lock held.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import secrets
import socket
import stat
import sys
import time
from pathlib import Path

from fedfeat.errors import FedfeatError
from fedfeat.store.urls import storage_error, store_location, url_filesystem


# ---------------------------------------------------------------------------------------- lock records
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, ValueError):  # not a possible pid
        return False
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux ``/proc/PID/stat`` field 22), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def lock_record(**extra) -> dict:
    """This process's lock record: pid, host, start time (UTC), boot id and start ticks where known."""
    rec = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    boot, ticks = _boot_id(), _start_ticks(os.getpid())
    if boot is not None and ticks is not None:
        rec.update(boot=boot, start_ticks=ticks)
    rec.update(extra)
    return rec


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (tests make it raise ENOSPC: a full disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_lock_file(path: Path, record: dict) -> None:
    """Create the lock ``path`` holding ``record``, atomically; ``FileExistsError`` if it exists. Any other
    ``OSError`` (a full disk) leaves nothing behind."""
    path = Path(path)
    data = json.dumps(record).encode()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # exclusive, and the lock appears complete
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
            _create_exclusive(path, data)  # a filesystem without hard links
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _create_exclusive(path: Path, data: bytes) -> None:
    """The fall-back of a filesystem without hard links: ``O_EXCL`` create, then write (the data was written once
    already, so the disk had room); a failed write removes the lock."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def read_lock(path: Path) -> tuple[bytes | None, dict | None]:
    """``(raw bytes, record)``: ``(None, None)`` when there is no lock, ``(raw, None)`` when it is not a record."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in its place must not block
    except FileNotFoundError:
        return None, None
    except OSError:
        return b"", None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"", None
        raw = os.read(fd, 1 << 16)
    except OSError:
        return b"", None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw, None
    ok = isinstance(doc, dict) and isinstance(doc.get("host"), str)
    ok = ok and isinstance(doc.get("pid"), int) and not isinstance(doc.get("pid"), bool) and doc["pid"] > 0
    return raw, doc if ok else None


def judge(record: dict | None) -> str | None:
    """Why a lock holding ``record`` is stale (a phrase for the message), or None when it is held."""
    if record is None:
        return "it is empty or unreadable, left by a writer that died while creating it"
    if record["host"] != socket.gethostname():
        return None  # another host's process cannot be checked from here
    pid = record["pid"]
    if pid == os.getpid():
        return None  # this process holds it
    boot = _boot_id()
    if record.get("boot") and boot and record["boot"] != boot:
        return f"pid {pid} wrote it before this machine restarted"
    if not _pid_alive(pid):
        return f"pid {pid} on {record['host']} since {record.get('since', '?')} is no longer running"
    ticks = record.get("start_ticks")
    if isinstance(ticks, int) and record.get("boot") == boot and _start_ticks(pid) not in (None, ticks):
        return f"pid {pid} on {record['host']} since {record.get('since', '?')} is no longer running (the pid is now another process's)"
    return None


@contextlib.contextmanager
def _guard(directory: Path):
    """An exclusive ``flock`` on ``directory`` while inside (released by the kernel if the process dies, so it is
    never stale): taking over a stale lock is one step at a time. Best effort where ``flock`` is unavailable."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the flock


def take_over(path: Path, raw: bytes) -> None:
    """Remove the stale lock ``path`` if it still holds ``raw`` (the bytes judged stale). Under the directory's
    ``flock``: of several processes taking over one stale lock, the first removes it and creates its own; the
    others find that lock, live, and are refused."""
    path = Path(path)
    with _guard(path.parent):
        now, _ = read_lock(path)
        if now == raw:
            path.unlink(missing_ok=True)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def acquire_lock_file(path: Path, record: dict, refuse, log=None, error=None) -> None:
    """Take the lock ``path`` for ``record``: a stale one is taken over (``log`` says so, stderr by default), a
    held one calls ``refuse(record_of_the_holder)``, which raises. ``error(OSError)`` makes the ``FedfeatError``
    of a failed write (a full disk)."""
    log = log or _warn
    for _ in range(5):
        try:
            write_lock_file(path, record)
            return
        except FileExistsError:
            pass
        except OSError as e:
            raise error(e) from None
        raw, holder = read_lock(path)
        if raw is None:  # released between our attempt and our read
            continue
        if holder is None:  # an older fedfeat's writer may be between its create and its write: look again
            time.sleep(0.1)
            again, holder = read_lock(path)
            if again != raw:
                continue
        why = judge(holder)
        if why is None:
            refuse(holder)
        log(f"taking over the stale lock {path} ({why})")
        try:
            take_over(path, raw)
        except OSError as e:
            raise error(e) from None
    raise FedfeatError(f"could not take the lock {path} (contended); re-run the command")


def release_lock_file(path: Path, record: dict) -> None:
    """Remove the lock ``path`` if it still holds ``record`` (never another writer's lock)."""
    _, holder = read_lock(path)
    if holder == record:
        Path(path).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- writer lock
class StoreLock:
    """One writer per store: ``STORE.lock`` beside the store (beside it, not inside: ``--force`` deletes the store
    directory), written atomically and judged by the rules of this module's docstring: an empty, unreadable or
    dead (same host) holder's lock is taken over with a message (``log``, stderr by default); a live holder, or
    one on another host, is refused with a message naming it and how to remove a stale lock. Use as a context
    manager; ``release`` removes only our own lock.

    A store at a URL (``memory://``, ``s3://``...) gets ``URL.lock`` the same way, but object stores have no
    exclusive create: the lock is written (one PUT: never half a lock) and then read back, which catches a holder
    that started earlier, not one that starts in the same instant (advisory: run one encode per store URL).

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
        self.log = log or _warn
        self.token: dict | None = None

    def _holder(self) -> dict | None:
        """The lock's record: ``{}`` when there is none, None when it is unreadable."""
        if isinstance(self.path, Path):
            raw, doc = read_lock(self.path)
            return {} if raw is None else doc
        try:
            fs, p = url_filesystem(self.path)
            raw = fs.cat_file(p)
        except FileNotFoundError:
            return {}
        except OSError:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
        ok = isinstance(doc, dict) and isinstance(doc.get("pid"), int) and isinstance(doc.get("host"), str)
        return doc if ok else None

    def _refuse(self, holder: dict) -> None:
        raise FedfeatError(
            f"{self.store} is being written by another `{holder.get('command', self.command)}` "
            f"(pid {holder['pid']} on host {holder['host']}, since {holder.get('since', '?')}); wait for it to "
            f"finish. If that process is gone (a crash on another host), remove {self.path} and re-run"
        ) from None

    def acquire(self) -> StoreLock:
        me = lock_record(command=self.command)
        if not isinstance(self.path, Path):
            return self._acquire_url(me)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage_error(e, self.path, "locking the store") from None
        acquire_lock_file(
            self.path, me, self._refuse, self.log, lambda e: storage_error(e, self.path, "locking the store")
        )
        self.token = me
        return self

    def _acquire_url(self, me: dict) -> StoreLock:
        fs, p = url_filesystem(str(self.path))
        try:
            for _ in range(3):
                holder = self._holder()
                if holder != {}:
                    why = judge(holder)
                    if why is None:
                        self._refuse(holder)
                    self.log(f"taking over the stale lock {self.path} ({why})")
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
        try:
            if isinstance(self.path, Path):
                release_lock_file(self.path, self.token)
            elif self._holder() == self.token:
                fs, p = url_filesystem(self.path)
                fs.rm_file(p)
        except OSError:
            pass
        self.token = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
