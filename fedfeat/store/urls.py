"""Where a store is: local paths and fsspec URLs (``memory://``, ``s3://``, ``gs://``; ``file://`` is a local path),
the filesystem behind a URL (with a one-line error naming the package to install), and whether a location holds a
complete store (``is_store``: its group metadata says so, nothing is opened for writing).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

from fedfeat.errors import FedfeatError

# ---------------------------------------------------------------------------------------- where a store lives
_OS_ADVICE = {
    errno.ENOSPC: ("no space left on device", "free space or choose another location"),
    errno.EDQUOT: ("disk quota exceeded", "free space or choose another location"),
    errno.EROFS: ("read-only file system", "choose a writable location"),
    errno.EACCES: ("permission denied", "fix the permissions or choose a writable location"),
    errno.EPERM: ("operation not permitted", "fix the permissions or choose a writable location"),
}


def storage_error(e: OSError, path: str | Path, action: str, fix: str | None = None) -> FedfeatError:
    """A one-line ``FedfeatError`` for an ``OSError`` raised while ``action`` at ``path``.

    Example::

        >>> str(storage_error(OSError(28, "No space left on device"), "cache/s.zarr", "writing the store"))
        'cannot finish writing the store at cache/s.zarr: no space left on device; free space or choose ...'
    """
    what, advice = _OS_ADVICE.get(e.errno, (e.strerror or str(e), "check the path and the filesystem"))
    where = f"{path}" + (f" ({e.filename})" if e.filename and str(e.filename) != str(path) else "")
    return FedfeatError(f"cannot finish {action} at {where}: {what}; {fix or advice}")


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# protocol -> the package fsspec needs for it (named in the error when it is missing)
FSSPEC_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "adl": "adlfs", "http": "aiohttp", "https": "aiohttp", "sftp": "paramiko",
}  # fmt: skip


def is_url(path: str | Path) -> bool:
    """True for a store at an fsspec URL other than ``file://`` (``memory://``, ``s3://``, ``gs://`` ...)."""
    if isinstance(path, Path):
        return False
    m = _URL.match(os.fspath(path))
    return m is not None and m.group(1).lower() not in ("file", "local")


def store_location(path: str | Path) -> Path | str:
    """Where a store lives: a local ``Path`` (``~`` expanded; ``file:///abs/x.zarr`` is ``/abs/x.zarr``) or, for
    any other fsspec URL, the URL itself (without a trailing ``/``); an unknown protocol or a missing filesystem
    package (``s3fs``, ``gcsfs``) is a one-line error.

    Example::

        >>> store_location("file:///data/c.zarr"), store_location("s3://bucket/c.zarr/")
        (PosixPath('/data/c.zarr'), 's3://bucket/c.zarr')
    """
    if isinstance(path, Path):
        return path.expanduser()
    s = os.fspath(path)
    m = _URL.match(s)
    if m is None:
        return Path(s).expanduser()
    if m.group(1).lower() in ("file", "local"):
        rest = s[m.end() :]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        from urllib.parse import unquote

        return Path(unquote(rest) or "/").expanduser()
    url = s.rstrip("/")
    url_filesystem(url)  # fail now, in one line, when its filesystem package is missing
    return url


def url_filesystem(url: str):
    """``(fsspec filesystem, path inside it)`` of a store URL (``is_url``)."""
    proto = url.split("://", 1)[0].lower()
    try:
        import fsspec
    except ImportError:
        raise FedfeatError(f"store URL {url} needs the fsspec package: pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        pkg = FSSPEC_PACKAGES.get(proto) or getattr(e, "name", None) or "its fsspec filesystem package"
        raise FedfeatError(
            f"store URL {url} needs the optional package {pkg} for {proto}://: pip install {pkg}"
        ) from None
    except ValueError as e:
        raise FedfeatError(
            f"store URL {url}: {e}; use a local path or an fsspec URL (file://, memory://, s3:// with s3fs, "
            "gs:// with gcsfs)"
        ) from None


def store_name(path: str | Path) -> str:
    """The last component of a store's path or URL (``cache/c.zarr`` and ``s3://b/c.zarr`` -> ``c.zarr``)."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def canonical_store(path: str | Path) -> str:
    """A store's location as recorded in run configs: an absolute local path, or the URL as given."""
    loc = store_location(path)
    return str(loc.resolve()) if isinstance(loc, Path) else loc


def store_exists(path: str | Path) -> bool:
    """Whether anything (a store, a directory, a file) is at ``path``."""
    loc = store_location(path)
    if isinstance(loc, Path):
        return loc.exists()
    fs, p = url_filesystem(loc)
    try:
        return bool(fs.exists(p))
    except OSError as e:
        raise storage_error(e, loc, "looking for the store", "check the URL and your credentials") from None
    except Exception as e:  # a filesystem's own errors (missing credentials, bad endpoint): one line
        raise _url_error(loc, e) from None


def _url_error(url: str, e: Exception) -> FedfeatError:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return FedfeatError(
        f"cannot read {url} ({type(e).__name__}: {first}); check the URL, the network and your credentials "
        "(the filesystem's usual configuration, e.g. AWS_* variables for s3://, or FSSPEC_<PROTOCOL>_<OPTION>)"
    )


def group_meta(path: str | Path) -> dict | None:
    """The ``zarr.json`` document at ``path`` (a dict), or ``None`` when there is none or it does not parse."""
    loc = store_location(path)
    try:
        if isinstance(loc, Path):
            meta = loc / "zarr.json"
            if not meta.is_file():
                return None
            raw = meta.read_bytes()
        else:
            fs, p = url_filesystem(loc)
            try:
                raw = fs.cat_file(f"{p}/zarr.json")
            except (OSError, ValueError):
                raise
            except Exception as e:  # a filesystem's own errors (missing credentials, bad endpoint): one line
                raise _url_error(loc, e) from None
        doc = json.loads(raw)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_store(path: str | Path) -> bool:
    """True when ``path`` (a local path or a store URL) holds a fedfeat store (complete or not)."""
    doc = group_meta(path)
    attrs = doc.get("attributes", {}) if doc is not None else None
    return isinstance(attrs, dict) and "format_version" in attrs
