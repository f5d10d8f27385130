"""Where a store is: local paths and fsspec URLs (``memory://``, ``s3://``, ``gs://``; chained URLs such as
``simplecache::s3://...``; ``file://`` is a local path), the filesystem behind a URL (with a one-line error naming
the package to install), and whether a location holds a complete store (``is_store``: its group metadata says so,
nothing is opened for writing).

Paths that must be local (run directories: ``--out`` of train / sweep / reproduce, ``--resume``, report paths, plot
and export files) go through ``local_path``: a ``file://`` URL is its local path, any other URL -- anything with
``://`` or ``::``, or a URL whose ``//`` ``pathlib.Path`` collapsed (``memory:/runs``) -- is refused in one line,
never read as a folder named ``memory:``.
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


# a URL whose "//" pathlib collapsed: Path("memory://runs") is memory:/runs (a protocol fsspec knows, then ":/")
_COLLAPSED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")
_LOCAL_PROTOCOLS = ("file", "local")


def _protocols() -> set[str]:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return {*_LOCAL_PROTOCOLS, "memory", *FSSPEC_PACKAGES}
    return {*known_implementations, *registry, *_LOCAL_PROTOCOLS}


def url_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is: ``None`` a plain local path; ``"file"`` a ``file://`` (``local://``) URL; ``"url"`` any
    other fsspec URL (``scheme://``, a chain with ``::``); ``"collapsed"`` a URL whose ``//`` became ``/`` (a
    ``pathlib.Path`` made of ``memory://runs`` is ``memory:/runs``: its protocol is one fsspec knows)."""
    s = os.fspath(path)
    if not isinstance(s, str):
        s = os.fsdecode(s)
    if "::" in s:
        return "url"
    m = _URL.match(s)
    if m is not None:
        return "file" if m.group(1).lower() in _LOCAL_PROTOCOLS else "url"
    m = _COLLAPSED.match(s)
    if m is not None and m.group(1).lower() in _protocols():
        return "collapsed"
    return None


def is_url(path: str | Path) -> bool:
    """True for a store at an fsspec URL other than ``file://`` (``memory://``, ``s3://``, ``gs://``, chained
    ``simplecache::s3://...``). A ``pathlib.Path`` is never a URL (``store_location`` refuses one that was)."""
    if isinstance(path, os.PathLike):
        return False
    return url_kind(path) == "url"


def _file_url_path(s: str) -> Path:
    """``file:///abs/x`` (or ``local://``, ``file://localhost/abs/x``) -> ``/abs/x``."""
    from urllib.parse import unquote

    rest = s[_URL.match(s).end() :]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost") :]
    return Path(unquote(rest) or "/").expanduser()


_URL_OPTIONS = "--store, `fedfeat info/partition STORE`, and the --out of encode and synth"


def local_path(path: str | os.PathLike, option: str = "--out", what: str = "a local directory") -> Path:
    """``path`` as a local ``Path`` for an option that only takes local paths (run directories, reports, plots):
    a ``file://`` URL is its local path; any other URL (``memory://``, ``s3://``, a ``::`` chain, or one that
    ``pathlib`` collapsed to ``memory:/...``) is a one-line ``FedfeatError`` naming the options that take URLs.

    Example::

        >>> local_path("file:///tmp/runs"), local_path("runs")
        (PosixPath('/tmp/runs'), PosixPath('runs'))
    """
    s = os.fspath(path)
    if not isinstance(s, str):
        s = os.fsdecode(s)
    kind, m = url_kind(s), _COLLAPSED.match(s)
    if kind == "file":
        return _file_url_path(s)
    if kind == "collapsed" and m.group(1).lower() in _LOCAL_PROTOCOLS:
        return Path(s[m.end() - 1 :]).expanduser()  # Path("file:///a") is file:/a
    if kind is not None:
        raise FedfeatError(
            f"{option} {s}: takes {what} (or a file:// URL), not a URL -- run directories and reports are "
            f"written locally; fsspec URLs (memory://, s3://, simplecache::...) are for stores: {_URL_OPTIONS}"
        )
    return Path(s).expanduser()


def store_location(path: str | Path, *, write: str | None = None) -> Path | str:
    """Where a store lives: a local ``Path`` (``~`` expanded; ``file:///abs/x.zarr`` is ``/abs/x.zarr``) or, for
    any other fsspec URL, the URL itself (without a trailing ``/``); an unknown protocol or a missing filesystem
    package (``s3fs``, ``gcsfs``) is a one-line error. A chained URL (``simplecache::s3://...``) is read through
    its chain; ``write`` (the option's name) refuses one as a place to write a store (fsspec's caching layers do
    not create the folders a store needs: write to the URL behind the chain).

    Example::

        >>> store_location("file:///data/c.zarr"), store_location("s3://bucket/c.zarr/")
        (PosixPath('/data/c.zarr'), 's3://bucket/c.zarr')
    """
    s = os.fspath(path)
    if not isinstance(s, str):
        s = os.fsdecode(s)
    kind = url_kind(s)
    if kind is None:
        return Path(s).expanduser()
    if kind == "file":
        return _file_url_path(s)
    m = _COLLAPSED.match(s)
    if kind == "collapsed" and m.group(1).lower() in _LOCAL_PROTOCOLS:
        return Path(s[m.end() - 1 :]).expanduser()  # Path("file:///a/s.zarr") is file:/a/s.zarr
    if isinstance(path, os.PathLike):
        raise FedfeatError(
            f"store path {s} is a URL made into a pathlib.Path (which collapses '//' and is always local); pass "
            "the URL as a str, e.g. 'memory://cache/s.zarr'"
        )
    if kind == "collapsed":
        raise FedfeatError(
            f"store location {s} looks like a {m.group(1)}:// URL with one '/'; write {m.group(1)}://"
            f"{s[m.end() :]} for the URL, or ./{s} for a local folder of that name"
        )
    url = s.rstrip("/")
    if write and "::" in url:
        raise FedfeatError(
            f"{write} {url}: a chained URL is read-only here; write the store to the URL behind the chain "
            f"({url.rsplit('::', 1)[-1]}) and read it through the chain"
        )
    url_filesystem(url)  # fail now, in one line, when its filesystem package is missing
    return url


def url_filesystem(url: str):
    """``(fsspec filesystem, path inside it)`` of a store URL (``is_url``)."""
    protos = [part.split("://", 1)[0].lower() for part in url.split("::")]  # a chain: every filesystem's
    proto = next((p for p in protos if p in FSSPEC_PACKAGES), protos[-1])
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
