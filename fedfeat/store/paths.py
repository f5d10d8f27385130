"""A store's path arguments and open modes, and what ``FeatureStore.create`` may replace at a path: never a file, a
folder of other things or a link's target; a fedfeat store only with ``overwrite``; a store cut short inside
``create`` always (``fedfeat.store.featurestore``, "Modes and deletion"). Where a path or URL points is
``fedfeat.store.urls``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fedfeat.errors import FedfeatError
from fedfeat.store.format import short as _short
from fedfeat.store.urls import group_meta, is_store, store_exists, url_filesystem

# FeatureStore.open's modes (zarr's own "w" truncates: fedfeat never passes it on to zarr)
MODES = ("r", "r+", "w")


def path_arg(path, what: str = "path", example: str = "cache/synth-cifar10.zarr") -> str | Path:
    """A path argument of the public API: a ``str`` (a path or a store URL) or any ``os.PathLike`` (a
    ``pathlib.Path``); anything else, bytes or an empty path is a one-line ``FedfeatError``."""
    if isinstance(path, os.PathLike) and not isinstance(path, Path):
        path = os.fspath(path)
    if isinstance(path, Path):
        return path
    if not isinstance(path, str):
        raise FedfeatError(
            f"{what} must be a str or os.PathLike (e.g. pathlib.Path), got {type(path).__name__} "
            f"{_short(path)}; e.g. {example!r}"
        )
    if not path.strip():
        raise FedfeatError(f"{what} is empty; e.g. {example!r}")
    return path


def check_mode(mode) -> str:
    """``mode`` of ``FeatureStore.open``: one of ``MODES``, else a one-line ``FedfeatError``."""
    if not isinstance(mode, str) or mode not in MODES:
        raise FedfeatError(
            f"mode must be r, r+ or w, got {_short(mode)}: r reads (the default), r+ writes into a store "
            "(partitions, a resumed encode), w rewrites one (a complete store needs overwrite=True); "
            "FeatureStore.create makes a new store"
        )
    return mode


# files and folders a store killed inside ``create`` can hold (besides its splits' groups)
_STORE_ENTRIES = {"zarr.json", "text", "partitions", "sources"}


def half_created(loc: Path | str, splits: set[str]) -> bool:
    """A location left by a process killed inside ``FeatureStore.create``: a zarr group without any attributes
    whose entries are only a store's own (its splits, text, partitions, sources). A user's zarr group with
    attributes or other entries is not one."""
    doc = group_meta(loc)
    if doc is None or doc.get("node_type") != "group" or doc.get("attributes") not in (None, {}):
        return False
    if isinstance(loc, Path):
        names = {e.name for e in loc.iterdir()}
    else:
        fs, p = url_filesystem(loc)
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)}
    return names <= _STORE_ENTRIES | splits


def refuse_dangling_link(loc: Path | str) -> None:
    """A symbolic link whose target is missing (an unmounted disk, a moved folder) is never replaced: writing
    there would put the store on another disk and delete the link."""
    if isinstance(loc, Path) and loc.is_symlink() and not loc.exists():
        raise FedfeatError(
            f"{loc} is a symbolic link to {os.readlink(loc)}, which does not exist (an unmounted disk?); mount or "
            "create its target, or remove the link yourself, or choose another path"
        )


def _clear_target(loc: Path | str, overwrite: bool, splits: set[str]) -> None:
    """Make room for a new store at ``loc`` (``create``), deleting only what fedfeat wrote.

    Nothing there, an empty folder, or a store cut short inside ``create`` (no attributes yet): go ahead, as
    ``fedfeat encode`` / ``synth`` do. A fedfeat store, complete or unfinished: only with ``overwrite``. A file, a
    folder of other things, a symbolic link to anything but a store: never, whatever ``overwrite`` says.
    A symbolic link to a store is replaced by the new store's folder (the link goes; its target stays)."""
    refuse_dangling_link(loc)
    if isinstance(loc, Path):
        if not loc.exists():
            return
        link = loc.is_symlink()
        if not link and loc.is_dir() and not any(loc.iterdir()):
            return  # an empty folder: zarr writes into it
    elif not store_exists(loc):
        return
    if is_store(loc):
        if not overwrite:  # an unfinished one too: its writer may still be at work (encode resumes it itself)
            attrs = (group_meta(loc) or {}).get("attributes", {})
            state = "an unfinished" if attrs.get("complete") is False else "a complete"
            raise FedfeatError(
                f"{loc} already exists ({state} store); pass overwrite=True (the CLI's --force) to replace it, "
                "or choose another path"
            )
    elif not (isinstance(loc, Path) and loc.is_symlink()) and half_created(loc, splits):
        pass
    else:
        raise FedfeatError(  # never delete what fedfeat did not write, even with overwrite
            f"{loc} exists and is not a fedfeat store; move it away yourself, or choose another path "
            "(overwrite=True, like --force, replaces stores only)"
        )
    if isinstance(loc, Path):
        if loc.is_symlink():
            loc.unlink()  # the link only: the store it points to is not ours to delete
        else:
            shutil.rmtree(loc)
    else:  # an object store has no directories: the prefix's objects go
        fs, p = url_filesystem(loc)
        fs.rm(p, recursive=True)
