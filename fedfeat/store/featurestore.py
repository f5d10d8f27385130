"""The feature store: one zarr v3 directory per dataset x backbone x weights.

Layout (``FORMAT_VERSION`` 2)::

    STORE.zarr/                      group attrs: see ``REQUIRED_ATTRS`` (+ "complete", "finite", "fingerprint_hash")
      <split>/features  [N, D] float16   unnormalised embeddings, row chunks of >= 1 MiB, zstd-1
      <split>/labels    [N]    int64     class ids; -1 marks a row skipped as unreadable (``encode --skip-bad``)
      <split>/labels_crc [1]   uint64    DONE_BIT | crc32 of the labels' bytes
      <split>/done      [n_chunks] uint64  0 = pending; DONE_BIT | crc32 of the chunk's float16 bytes once that
                                         feature chunk is written whole (one file per entry)
      text/features     [T, K, D] float16  one class embedding per template x class
      text/done         [1] uint64       DONE_BIT | crc32 of the text features
      sources/          attrs "files": {name: [size, content hash]} of the dataset files read (``encode``)
      partitions/<key>/order    [M] int64   client-major sample positions into the split
      partitions/<key>/offsets  [clients + 1] int64   client i holds order[offsets[i]:offsets[i+1]]
                                            attrs: scheme, params (incl. seed), split

Crash safety: a writer fills a whole feature chunk, then sets its ``done`` entry (which carries the chunk's
checksum: one small file, written last); the group's ``complete`` attribute is set last, after every chunk
and the text embeddings are done. ``open`` refuses a store whose ``complete`` flag is not set. Several
processes may write at once as long as each owns whole chunks and their ``done`` entries (zarr silently
loses data when two writers share a chunk).

Integrity (why format version 2): zarr reads a missing chunk file as zeros, so a deleted or truncated store
would otherwise train on all-zero features. Every feature chunk, the labels and the text features carry a
crc32 of their bytes, written by the process that wrote the data. ``features(split)``, ``text_features()``
and ``labels(split)`` verify the checksums of everything they read (crc32 runs at > 1 GB/s; the decode costs
more) and refuse non-finite values; ``features_rows`` reads and verifies whole chunks; ``verify()`` (``fedfeat
info --verify``) checks everything. A failure is a one-line ``FedfeatError`` naming the split, the chunk and its
rows (or the first non-finite row) and how to rebuild. Non-finite features are refused when written, and a
complete store records ``finite: true``; a complete store without that record is scanned once on open (and the
result recorded when it is opened writable). Stores of format version 1 (no checksums) are refused with the
rebuild message: their contents cannot be verified.

Attributes vs arrays (``attribute_problems``): every attribute the writers record is checked against the arrays
it describes -- ``embed_dim`` against every feature array's D, ``class_names`` and ``templates`` against
``text/features`` [T, K, D] (and the labels' class ids), ``splits`` against every array's rows, ``chunk_rows``
against the chunking and the done / checksum arrays, the format's dtypes, ``pixels`` against the pixel arrays,
``logit_scale`` finite and > 0, the fingerprint's fields (and its hash) against the attributes, ``skipped``
against the -1 labels, the stored partitions against their split. ``open`` runs the metadata-only part (types,
shapes, chunks, dtypes: no data read), so ``train``, ``info`` and the rest refuse a lying store in one line;
``verify`` runs all of it and names each disagreement on a line of its own.

Modes and deletion: ``open`` takes ``mode`` r, r+ or w and never deletes anything (zarr's own "w", which truncates,
is never passed on); "w" rewrites an existing store's chunks: an unfinished one is resumed, a complete one needs
``overwrite=True`` and is marked unfinished until ``mark_complete``. ``create`` (and ``copy_store``) replace a
fedfeat store only with ``overwrite=True``, and never a file, a folder of other things or a link's target (a link
to a store is replaced, its target kept; a link to a missing target is refused). Paths are ``str`` or any
``os.PathLike`` (``path_arg``).

Read-only use: ``open(path, mode="r")`` (the default) never writes anything (no lock files, attributes or zarr
metadata), so stores on read-only filesystems can be read and partitioned in memory.

Where a store lives (``store_location``): a local path (``~`` expanded; a ``file://`` URL is the same local path),
or an fsspec URL -- ``memory://``, ``s3://`` (needs ``s3fs``), ``gs://`` (needs ``gcsfs``), any protocol fsspec
knows -- which zarr reads and writes through ``zarr.storage.FsspecStore``; credentials and options come from the
filesystem's usual configuration (environment variables, config files, ``FSSPEC_<PROTOCOL>_<OPTION>`` variables).
A missing filesystem package is a one-line error naming it. ``FeatureStore.path`` is a ``Path`` for local stores and
the URL string for the others. Crash safety on object stores: there is no atomic rename, but every object (a
chunk, a done entry, a ``zarr.json``) is written by one whole PUT, which S3 and GCS make visible all at once and
read back consistently; the write order above (chunk, then its done entry, ``complete`` last) and the checksums
keep their meaning, so an interrupted encode resumes and an incomplete store is never read as complete. What an
object store lacks is an exclusive create: ``STORE.lock`` is advisory there (written, then read back; two encodes
started within the same instant can both proceed), so run one encode per store URL.

Example::

    >>> st = FeatureStore.open("cache/synth-cifar10.zarr")
    >>> st.features("train").shape, st.class_names[:2]
    ((50000, 1024), ['airplane', 'automobile'])

Why one module over 600 lines: ``FeatureStore`` is the format. Its reads, writes and checks (done entries with
crc32, ``complete`` written last, fingerprints, partitions' arrays) keep each other's invariants, and a reader of
the format finds them in one class. Where a store is (paths, fsspec URLs) is ``fedfeat.store.urls``; its writer
lock ``fedfeat.store.lock``.
"""

from __future__ import annotations

import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from fedfeat.errors import FedfeatError
from fedfeat.store.checks import AttrCheck as _AttrCheck
from fedfeat.store.checks import partition_problems as _partition_problems
from fedfeat.store.format import FORMAT_VERSION, fingerprint_hash  # noqa: F401  (re-exported)
from fedfeat.store.format import short as _short
from fedfeat.store.urls import (
    group_meta,
    is_store,
    storage_error,
    store_exists,
    store_location,
    url_filesystem,
)

MIN_CHUNK_BYTES = 1 << 20  # a feature chunk is at least 1 MiB (fewer, larger files; zarr reads whole chunks)
DONE_BIT = 1 << 32  # a done entry is DONE_BIT | crc32: never 0 (zarr's fill value for a missing entry)
_F16_EXP = np.uint16(0x7C00)  # float16 exponent bits: all set means inf or NaN

REQUIRED_ATTRS = (
    "format_version",
    "backbone",  # open_clip architecture name, or "synthetic"
    "pretrained",  # open_clip tag, checkpoint file name, or "none"
    "embed_dim",
    "logit_scale",  # the model's exp(logit_scale), e.g. 100.0 for CLIP
    "class_names",
    "templates",  # prompt templates, one per row of text/features
    "preprocessing",  # dict describing the image transform
    "fingerprint",  # dict: everything that determines the contents
    "splits",  # dict split -> number of rows
)


# errno -> (what happened, what to do), for writes that fail on the filesystem
def crc(a: np.ndarray) -> int:
    """crc32 of an array's C-order bytes (the checksum stored beside every chunk)."""
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def first_nonfinite_row(a: np.ndarray) -> int | None:
    """Index of the first row (along axis 0) holding NaN or inf, or None (float16 via its exponent bits)."""
    a = np.asarray(a)
    if a.dtype == np.float16:
        bad = (a.view(np.uint16) & _F16_EXP) == _F16_EXP
    else:
        bad = ~np.isfinite(a)
    if not bad.any():
        return None
    return int(np.flatnonzero(bad.reshape(len(a), -1).any(axis=1))[0])


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


def default_chunk_rows(embed_dim: int) -> int:
    """Rows per feature chunk: the smallest power of two whose float16 chunk is >= 1 MiB."""
    rows = MIN_CHUNK_BYTES / (2 * embed_dim)
    return 1 << max(0, math.ceil(math.log2(rows)))


class FeatureStore:
    """A fedfeat feature store on disk or at an fsspec URL. Use ``create`` to start one and ``open`` to read one."""

    def __init__(self, path: Path | str, group: zarr.Group, mode: str = "r"):
        self.path = path
        self._g = group
        self._mode = mode
        self._attrs = dict(group.attrs)

    # ------------------------------------------------------------------ creation / opening
    @classmethod
    def create(
        cls,
        path: str | Path,
        *,
        backbone: str,
        pretrained: str,
        embed_dim: int,
        logit_scale: float,
        class_names: list[str],
        templates: list[str],
        preprocessing: dict,
        fingerprint: dict,
        labels: dict[str, np.ndarray],
        chunk_rows: int | None = None,
        extra_attrs: dict | None = None,
        sources: dict | None = None,
        overwrite: bool = False,
        pixels: dict | None = None,
    ) -> FeatureStore:
        """Create an empty, incomplete store with its labels written and its feature chunks pending.

        ``labels`` maps each split name ("train", "test", ...) to its ``[N]`` label array; the
        feature arrays are pre-sized (one process creates, writers only fill whole chunks).
        ``sources``: ``{file name: [size, content hash]}`` of the dataset files (``encode``).
        ``pixels``: ``{"size": [H, W], "mean": [3], "std": [3]}`` to also keep every image as the model's uint8 input
        after its resize and centre crop (``encode --pixels``; live image methods read them).
        """
        if not isinstance(overwrite, bool):
            raise FedfeatError(f"overwrite must be True or False, got {_short(overwrite)}")
        path = store_location(path_arg(path))
        _clear_target(path, overwrite, set(labels))
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        chunk_rows = int(chunk_rows or default_chunk_rows(embed_dim))
        g = zarr.open_group(str(path), mode="w", zarr_format=3)
        attrs: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "backbone": backbone,
            "pretrained": pretrained,
            "embed_dim": int(embed_dim),
            "logit_scale": float(logit_scale),
            "class_names": list(class_names),
            "templates": list(templates),
            "preprocessing": preprocessing,
            "fingerprint": fingerprint,
            "fingerprint_hash": fingerprint_hash(fingerprint),
            "splits": {k: int(len(v)) for k, v in labels.items()},
            "chunk_rows": chunk_rows,
            "complete": False,
        }
        attrs.update(extra_attrs or {})
        if pixels is not None:
            attrs["pixels"] = {"size": [int(v) for v in pixels["size"]], "mean": [float(v) for v in pixels["mean"]],
                               "std": [float(v) for v in pixels["std"]]}  # fmt: skip
        st = cls(path, g, mode="w")
        for split, lab in labels.items():
            lab = np.asarray(lab, dtype=np.int64)
            n = len(lab)
            if n == 0:
                raise FedfeatError(f"split '{split}' has no samples; check the dataset root")
            sg = g.require_group(split)
            sg.create_array(
                "features",
                shape=(n, embed_dim),
                chunks=(min(chunk_rows, n), embed_dim),
                dtype="float16",
                compressors=ZstdCodec(level=1),
                fill_value=0,
            )
            sg.create_array("labels", shape=(n,), chunks=(max(n, 1),), dtype="int64", fill_value=-1)
            sg.create_array("labels_crc", shape=(1,), chunks=(1,), dtype="uint64", fill_value=0)
            st._write_labels(split, lab)
            sg.create_array(
                "done", shape=(math.ceil(n / chunk_rows),), chunks=(1,), dtype="uint64", fill_value=0
            )
            if pixels is not None:
                H, W = (int(v) for v in pixels["size"])
                sg.create_array(
                    "pixels",
                    shape=(n, 3, H, W),
                    chunks=(min(chunk_rows, n), 3, H, W),
                    dtype="uint8",
                    compressors=ZstdCodec(level=1),
                    fill_value=0,
                )
                sg.create_array(
                    "pixels_crc",
                    shape=(math.ceil(n / chunk_rows),),
                    chunks=(1,),
                    dtype="uint64",
                    fill_value=0,
                )
        tg = g.require_group("text")
        tg.create_array(
            "features",
            shape=(len(templates), len(class_names), embed_dim),
            chunks=(len(templates), len(class_names), embed_dim),
            dtype="float16",
            compressors=ZstdCodec(level=1),
            fill_value=0,
        )
        tg.create_array("done", shape=(1,), chunks=(1,), dtype="uint64", fill_value=0)
        g.require_group("partitions")
        g.require_group("sources").attrs.update({"files": sources or {}})
        # attributes last: a half-created store has no format_version and is "not a store"
        g.attrs.update(attrs)
        st._refresh()
        return st

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        mode: str = "r",
        allow_incomplete: bool = False,
        overwrite: bool = False,
        check: bool = True,
    ) -> FeatureStore:
        """Open an existing store; refuse paths that are not stores, other format versions, stores whose
        attributes disagree with their arrays' shapes and dtypes (``check``; ``verify`` checks everything) and
        (unless ``allow_incomplete``) stores whose writing never finished.

        ``mode="r"`` (the default) never writes to the store or next to it: it works on read-only
        filesystems. ``mode="r+"`` is for writers (``encode``, saving partitions). ``mode="w"`` opens a store to
        rewrite its chunks: an unfinished one is resumed; a complete one needs ``overwrite=True`` and is marked
        unfinished until ``mark_complete``. Opening never deletes anything: ``create`` makes a new store (and
        replaces a store only with ``overwrite=True``).
        """
        check_mode(mode)
        for name, flag in (
            ("allow_incomplete", allow_incomplete),
            ("overwrite", overwrite),
            ("check", check),
        ):
            if not isinstance(flag, bool):
                raise FedfeatError(f"{name} must be True or False, got {_short(flag)}")
        path = store_location(path_arg(path))
        if mode == "w":
            if store_exists(path) and not is_store(path):
                raise FedfeatError(
                    f"{path} exists and is not a fedfeat store; move it away yourself, or choose another path "
                    "(mode w rewrites stores only)"
                )
            allow_incomplete = True
        if not store_exists(path):
            raise FedfeatError(
                f"no store at {path}; create one with `fedfeat synth --out {path}` or `fedfeat encode`"
                if isinstance(path, Path)
                else f"no store at {path}; write one there with `fedfeat encode --out URL`, or copy a store there"
            )
        if not is_store(path):
            raise FedfeatError(
                f"{path} is not a fedfeat store (no store attributes in zarr.json); "
                "point to a directory made by `fedfeat synth` or `fedfeat encode`"
            )
        try:  # zarr's "w" would truncate the store: "w" is a writer's open, "r+" to zarr
            g = zarr.open_group(str(path), mode="r" if mode == "r" else "r+", zarr_format=3)
        except OSError as e:
            raise storage_error(e, path, "opening the store", "open it with mode 'r' (read only)") from None
        except Exception as e:
            if not isinstance(path, Path):  # a remote store: more likely the connection or credentials
                first = (str(e).strip().splitlines() or [""])[0][:200]
                raise FedfeatError(
                    f"cannot open store {path} ({type(e).__name__}: {first}); check the URL, your credentials, "
                    "or rebuild it with `fedfeat encode --force`"
                ) from None
            # unreadable zarr metadata: the store is damaged, not the program
            raise FedfeatError(
                f"store {path} is damaged ({type(e).__name__}: {e}); rebuild it with `fedfeat encode --force` "
                "(or `fedfeat synth --force`)"
            ) from None
        st = cls(path, g, mode=mode)
        version = st._attrs.get("format_version")
        if version != FORMAT_VERSION:
            raise FedfeatError(
                f"{path} has store format version {version}, this fedfeat reads version {FORMAT_VERSION}; "
                f"rebuild it with this version's {st._rebuild_hint()}"
            )
        missing = [k for k in REQUIRED_ATTRS if k not in st._attrs]
        if missing:
            raise st._damaged(f"its attributes lack {', '.join(missing)}")
        if check:
            st._refuse_problems(st.attribute_problems(deep=False), hint=True)
        if not allow_incomplete and not st.complete:
            raise FedfeatError(
                f"{path} is incomplete (its writing was interrupted); re-run the same `fedfeat encode` "
                "command to resume it, or `fedfeat synth --force` for a synthetic store"
            )
        if mode == "w" and st.complete:
            if not overwrite:
                raise FedfeatError(
                    f"{path} already exists (a complete store); pass overwrite=True (the CLI's --force) to rewrite "
                    "it, open it with mode 'r' to read it or 'r+' to add partitions, or choose another path"
                )
            try:  # unfinished until mark_complete: a writer killed midway leaves no store that reads as complete
                st.update_attrs(complete=False)
            except OSError as e:
                raise storage_error(
                    e, path, "opening the store for writing", "open it with mode 'r'"
                ) from None
        if st.complete and st._attrs.get("finite") is not True:
            st._check_finite_once()
        return st

    def _rebuild_hint(self) -> str:
        if self._attrs.get("backbone") == "synthetic":
            return "`fedfeat synth --force`"
        return "`fedfeat encode --force` (or `fedfeat synth --force` for a synthetic store)"

    def _damaged(self, what: str) -> FedfeatError:
        return FedfeatError(f"store {self.path}: {what}; rebuild the store with {self._rebuild_hint()}")

    def _arr(self, name: str) -> zarr.Array:
        """The array ``name``; a missing or unreadable one means a damaged store (one-line error)."""
        try:
            return self._g[name]
        except Exception as e:  # zarr raises KeyError, ValueError, JSON errors... for broken metadata
            raise self._damaged(f"array {name} is missing or unreadable ({type(e).__name__})") from None

    def _read(self, name: str, sel=slice(None), what: str = "") -> np.ndarray:
        arr = self._arr(name)
        try:
            return np.asarray(arr[sel])
        except OSError as e:
            raise storage_error(e, self.path, f"reading {name}") from None
        except Exception as e:  # a chunk that does not decode (truncated or overwritten file)
            where = f"{name} {what}".strip()
            raise self._damaged(f"{where} does not decode ({type(e).__name__}: {e})") from None

    def _read_chunk(self, split: str, i: int) -> np.ndarray:
        sl = self.chunk_slice(split, i)
        return self._read(f"{split}/features", sl, f"chunk {i} (rows {sl.start}-{sl.stop - 1})")

    def _check_finite_once(self) -> None:
        """A complete store without the ``finite`` record: scan it, record the result when writable."""
        for split in self.splits:
            self._refuse_nonfinite(f"{split}/features", self._read(f"{split}/features"))
        self._refuse_nonfinite("text/features", self._read("text/features"))
        if self._mode != "r":
            self.update_attrs(finite=True)

    def _refuse_nonfinite(self, name: str, a: np.ndarray, row0: int = 0) -> None:
        r = first_nonfinite_row(a)
        if r is not None:
            where = (
                f"row {row0 + r}"
                if a.ndim == 2
                else f"template {r}, class {first_nonfinite_row(a[r])}"  # text: [T, K, D]
            )
            raise self._damaged(f"{name} {where} is not finite (NaN or inf)")

    # ------------------------------------------------------------------ attributes vs arrays
    def _refuse_problems(self, problems: list[str], log=None, hint: bool = False) -> None:
        """Raise one line for attribute/array disagreements (each also logged, one line each, when ``log``;
        ``hint``: name ``fedfeat info --verify``, which lists them all)."""
        if not problems:
            return
        if log is not None:
            for p in problems:
                log(p)
        more = len(problems) - 1
        rest = f" (and {more} more{', listed above' if log is not None else ''})" if more else ""
        if all(p.startswith("partition ") for p in problems):  # the features are fine: redo the partitions
            raise FedfeatError(
                f"store {self.path}: {problems[0]}{rest}; make the partition again with `fedfeat partition` (it "
                "is recomputed exactly)"
            )
        raise self._damaged(
            f"{problems[0]}{rest}" + ("; `fedfeat info --verify` lists every disagreement" if hint else "")
        )

    def attribute_problems(self, deep: bool = True) -> list[str]:
        """Every disagreement between the store's attributes and its arrays, one line each, naming the attribute,
        its value and what the arrays say. ``deep=False``: attribute types, array shapes, chunking and dtypes only
        (array metadata, no data read: what ``open`` checks). ``deep=True`` (``verify``) also reads the labels
        (class ids vs ``class_names``, ``skipped``), the partitions and checks the fingerprint's fields."""
        return _AttrCheck(self).run(deep)

    # ------------------------------------------------------------------ attributes
    @property
    def attrs(self) -> dict:
        return dict(self._attrs)

    def _refresh(self) -> None:
        self._attrs = dict(self._g.attrs)

    @property
    def complete(self) -> bool:
        return bool(self._attrs.get("complete", False))

    @property
    def embed_dim(self) -> int:
        return int(self._attrs["embed_dim"])

    @property
    def class_names(self) -> list[str]:
        return list(self._attrs["class_names"])

    @property
    def n_classes(self) -> int:
        return len(self._attrs["class_names"])

    @property
    def templates(self) -> list[str]:
        return list(self._attrs["templates"])

    @property
    def logit_scale(self) -> float:
        return float(self._attrs["logit_scale"])

    @property
    def fingerprint(self) -> dict:
        return dict(self._attrs["fingerprint"])

    @property
    def splits(self) -> list[str]:
        return list(self._attrs["splits"])

    def n(self, split: str) -> int:
        self._check_split(split)
        return int(self._attrs["splits"][split])

    def _check_split(self, split: str) -> None:
        if not isinstance(split, str) or split not in self._attrs["splits"]:
            raise FedfeatError(f"store {self.path} has no split {split!r}; it has: {', '.join(self.splits)}")

    def sources(self) -> dict:
        """``{file name: [size, content hash]}`` of the dataset files the store was encoded from."""
        try:
            return dict(self._g["sources"].attrs.get("files", {}))
        except KeyError:
            return {}

    def set_sources(self, files: dict) -> None:
        self._g.require_group("sources").attrs.update({"files": files})

    # ------------------------------------------------------------------ chunked writing
    @property
    def chunk_rows(self) -> int:
        return int(self._attrs["chunk_rows"])

    def n_chunks(self, split: str) -> int:
        return math.ceil(self.n(split) / self.chunk_rows)

    def chunk_slice(self, split: str, i: int) -> slice:
        """Rows of feature chunk ``i`` of ``split``."""
        r = self.chunk_rows
        return slice(i * r, min((i + 1) * r, self.n(split)))

    def _done(self, split: str) -> np.ndarray:
        """``[n_chunks]`` uint64 done entries (0: pending, else DONE_BIT | crc32)."""
        self._check_split(split)
        return self._read(f"{split}/done").astype(np.uint64)

    def done_chunks(self, split: str) -> np.ndarray:
        """``[n_chunks]`` bool: which feature chunks are written whole."""
        return self._done(split) != 0

    @property
    def has_pixels(self) -> bool:
        return "pixels" in self.attrs

    def write_chunk(self, split: str, i: int, feats: np.ndarray, pixels: np.ndarray | None = None) -> None:
        """Write feature chunk ``i`` whole (``feats  # [rows, D]``), then record it as done with its checksum.
        A store with pixels takes the chunk's ``pixels  # [rows, 3, H, W]`` uint8 too, written (with their own
        checksum) before the features: a chunk is done only when both are.

        Non-finite values (also float16 overflow) are refused: a store holds finite features only.
        """
        sl = self.chunk_slice(split, i)
        if self.has_pixels:
            H, W = self.attrs["pixels"]["size"]
            px = np.ascontiguousarray(pixels, dtype=np.uint8) if pixels is not None else None
            if px is None or px.shape != (sl.stop - sl.start, 3, H, W):
                raise ValueError(
                    f"chunk {i} of {split} needs pixels of shape {(sl.stop - sl.start, 3, H, W)}"
                )
            self._g[f"{split}/pixels"][sl] = px
            self._g[f"{split}/pixels_crc"][i] = DONE_BIT | crc(px)
        feats = np.asarray(feats)
        if feats.shape != (sl.stop - sl.start, self.embed_dim):
            raise ValueError(
                f"chunk {i} of {split} needs shape {(sl.stop - sl.start, self.embed_dim)}, got {feats.shape}"
            )
        with np.errstate(over="ignore"):  # beyond float16's range becomes inf, refused just below
            f16 = np.ascontiguousarray(feats.astype(np.float16))
        r = first_nonfinite_row(f16)
        if r is not None:
            raise FedfeatError(
                f"store {self.path}: refusing to write {split}/features row {sl.start + r}: not finite "
                "(NaN or inf, or beyond float16's range)"
            )
        self._g[f"{split}/features"][sl] = f16
        self._g[f"{split}/done"][i] = DONE_BIT | crc(f16)

    def clear_chunks(self, split: str, chunks) -> None:
        """Mark chunks pending again (their features are re-encoded); the store becomes incomplete."""
        self.update_attrs(complete=False)
        for i in chunks:
            self._g[f"{split}/done"][int(i)] = 0

    def _write_labels(self, split: str, labels: np.ndarray) -> None:
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        self._g[f"{split}/labels"][:] = labels
        self._g[f"{split}/labels_crc"][0] = DONE_BIT | crc(labels)

    def set_labels(self, split: str, rows: slice, labels: np.ndarray) -> None:
        """Overwrite labels of ``rows`` (used to mark unreadable images with -1); one process only."""
        full = self.labels(split).copy()
        full[rows] = np.asarray(labels, dtype=np.int64)
        self._write_labels(split, full)

    def write_text(self, feats: np.ndarray) -> None:
        """Write the class-prompt embeddings ``feats  # [T, K, D]`` and record them as done."""
        want = (len(self.templates), self.n_classes, self.embed_dim)
        if tuple(feats.shape) != want:
            raise ValueError(f"text features need shape {want}, got {tuple(feats.shape)}")
        with np.errstate(over="ignore"):
            f16 = np.ascontiguousarray(np.asarray(feats).astype(np.float16))
        r = first_nonfinite_row(f16.reshape(-1, self.embed_dim))
        if r is not None:
            raise FedfeatError(
                f"store {self.path}: refusing to write text/features template {r // self.n_classes}, "
                f"class {r % self.n_classes}: not finite (NaN or inf)"
            )
        self._g["text/features"][:] = f16
        self._g["text/done"][0] = DONE_BIT | crc(f16)

    def text_done(self) -> bool:
        return bool(self._read("text/done")[0])

    def missing(self) -> dict[str, int]:
        """Pending work: split -> number of chunks not yet done (and "text" -> 1 if pending)."""
        out = {s: int((~self.done_chunks(s)).sum()) for s in self.splits}
        out["text"] = 0 if self.text_done() else 1
        return out

    def update_attrs(self, **attrs: Any) -> None:
        self._g.attrs.update(attrs)
        self._refresh()

    def mark_complete(self) -> None:
        """Set the complete flag, after checking that every chunk and the text embeddings are done."""
        pending = {k: v for k, v in self.missing().items() if v}
        if pending:
            raise RuntimeError(f"cannot mark {self.path} complete: pending chunks {pending}")
        self.update_attrs(complete=True, finite=True)  # write_chunk / write_text refuse non-finite values

    # ------------------------------------------------------------------ reading (verified)
    def _check_chunk(self, split: str, i: int, block: np.ndarray, entry: int) -> None:
        """Refuse chunk ``i`` of ``split`` (``block  # [rows, D]`` float16) unless it is finite and its
        checksum matches the one recorded when it was written."""
        sl = self.chunk_slice(split, i)
        self._refuse_nonfinite(f"{split}/features", block, sl.start)
        rows = f"rows {sl.start}-{sl.stop - 1}"
        if entry == 0:
            if self.complete:
                raise self._damaged(
                    f"{split}/features chunk {i} ({rows}) has no checksum record (its done entry is missing)"
                )
            raise FedfeatError(
                f"store {self.path}: {split}/features chunk {i} ({rows}) is not written yet; "
                "resume the store with the same `fedfeat encode` command"
            )
        if DONE_BIT | crc(block) != entry:
            raise self._damaged(
                f"{split}/features chunk {i} ({rows}) does not match its checksum "
                "(chunk file missing, truncated or changed)"
            )

    def features(self, split: str) -> np.ndarray:
        """All features of ``split``: ``[N, D]`` float16, unnormalised.

        Every chunk is verified against its checksum and for finite values; a failure raises a one-line
        ``FedfeatError`` naming the split, the chunk and its rows (or the first non-finite row).
        """
        self._check_split(split)
        memo = getattr(self, "memo", None)  # a sweep's session keeps verified splits in memory (read-only)
        if memo is not None and ("features", split) in memo:
            return memo[("features", split)]
        done = self._done(split)
        try:
            out = self._read(f"{split}/features")  # [N, D]: one read is faster than one per chunk
        except FedfeatError:  # a chunk that does not decode: find it, to name it
            for i in range(len(done)):
                self._read_chunk(split, i)
            raise
        for i in range(len(done)):
            self._check_chunk(split, i, out[self.chunk_slice(split, i)], int(done[i]))
        if memo is not None:
            out.setflags(write=False)
            memo[("features", split)] = out
        return out

    def features_rows(self, split: str, rows: np.ndarray) -> np.ndarray:
        """Features of the given rows only: reads (and verifies) only the chunks holding them."""
        self._check_split(split)
        rows = _rows_arg(rows)
        n = self.n(split)
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise FedfeatError(
                f"store {self.path}: rows outside 0..{n - 1} of split {split}; pass row positions"
            )
        out = np.empty((len(rows), self.embed_dim), dtype=np.float16)
        done = self._done(split)
        chunk_of = rows // self.chunk_rows
        for i in np.unique(chunk_of):
            sl = self.chunk_slice(split, int(i))
            block = self._read_chunk(split, int(i))
            self._check_chunk(split, int(i), block, int(done[i]))
            sel = chunk_of == i
            out[sel] = block[rows[sel] - sl.start]
        return out

    def pixels(self, split: str, rows) -> np.ndarray:
        """The stored model inputs of ``rows``: ``[n, 3, H, W]`` uint8 after the model's resize and centre crop
        (``normalize_pixels`` makes them the model's float input); the chunks read are checked against their
        checksums."""
        if not self.has_pixels:
            raise FedfeatError(
                f"store {self.path} keeps no pixels; re-encode it with `fedfeat encode ... --pixels` (live image "
                "methods read images from the store)"
            )
        self._check_split(split)
        rows = _rows_arg(rows)
        H, W = self.attrs["pixels"]["size"]
        out = np.empty((len(rows), 3, H, W), dtype=np.uint8)
        crcs = self._read(f"{split}/pixels_crc").astype(np.uint64)
        chunk_of = rows // self.chunk_rows
        for c in np.unique(chunk_of):
            sl = self.chunk_slice(split, int(c))
            block = self._read(f"{split}/pixels", sl, f"chunk {int(c)}")
            if DONE_BIT | crc(np.ascontiguousarray(block)) != int(crcs[c]):
                raise self._damaged(f"{split}/pixels chunk {int(c)} does not match its checksum")
            sel = chunk_of == c
            out[sel] = block[rows[sel] - sl.start]
        return out

    def labels(self, split: str) -> np.ndarray:
        """``[N]`` int64 labels of ``split`` (-1: row skipped as unreadable), checked against their checksum."""
        self._check_split(split)
        lab = self._read(f"{split}/labels")
        entry = int(self._read(f"{split}/labels_crc")[0])
        if entry != DONE_BIT | crc(lab.astype(np.int64)):
            raise self._damaged(
                f"{split}/labels (rows 0-{len(lab) - 1}) does not match its checksum "
                "(chunk file missing, truncated or changed)"
            )
        return lab

    def text_features(self) -> np.ndarray:
        """``[T, K, D]`` float16 class-prompt embeddings, unnormalised; verified like ``features``."""
        text = self._read("text/features")
        self._refuse_nonfinite("text/features", text)
        entry = int(self._read("text/done")[0])
        if entry == 0 and not self.complete:
            raise FedfeatError(f"store {self.path}: text/features are not written yet; resume the store")
        if entry != DONE_BIT | crc(text):
            raise self._damaged(
                "text/features does not match its checksum (chunk file missing, truncated or changed)"
            )
        return text

    def verify(self, log=None) -> dict:
        """Check every attribute against the arrays (``attribute_problems``), then every written chunk, the
        labels, the text features and the stored partitions against their checksums (``fedfeat info --verify``).

        Attribute disagreements: one ``FedfeatError`` line naming the first (and, when ``log`` is given, each one
        passed to ``log`` as a line of its own first); a damaged chunk: a one-line ``FedfeatError`` at the first
        one. Returns counts of what was checked. Pending chunks of an incomplete store are skipped (they are not
        written yet).
        """
        self._refuse_problems(self.attribute_problems(deep=True), log)
        checked = {"chunks": 0, "rows": 0}
        for split in self.splits:
            self.labels(split)
            done = self._done(split)
            for i in np.flatnonzero(done != 0) if not self.complete else range(len(done)):
                sl = self.chunk_slice(split, int(i))
                self._check_chunk(split, int(i), self._read_chunk(split, int(i)), int(done[i]))
                checked["chunks"] += 1
                checked["rows"] += sl.stop - sl.start
        if self.complete or self.text_done():
            self.text_features()
            checked["text"] = 1
        for key in self.partition_keys():
            self.partition_arrays(key)  # checksums, and offsets / order against the split
        return checked

    # ------------------------------------------------------------------ partitions
    def save_partition_arrays(
        self,
        key: str,
        scheme: str,
        params: dict,
        order: np.ndarray,
        offsets: np.ndarray,
        split: str = "train",
    ) -> str:
        """Store a partition of ``split`` under ``partitions/<key>``: ``order  # [n]`` split rows, client-major;
        ``offsets  # [clients + 1]``; its scheme and parameters (``fedfeat.partition.stored`` makes them)."""
        self._check_split(split)
        # probe first: on a read-only store zarr's concurrent writes fail in background tasks that print their
        # own tracebacks ("Task exception was never retrieved") beside the caller's one-line error
        if isinstance(self.path, Path):
            probe = self.path / f".write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        else:
            fs, p = url_filesystem(self.path)
            fs.pipe_file(f"{p}/.write-probe-{os.getpid()}", b"")
            fs.rm_file(f"{p}/.write-probe-{os.getpid()}")
        pg = self._g.require_group("partitions")
        if key in pg:
            del pg[key]
        kg = pg.require_group(key)
        kg.create_array("order", shape=order.shape, chunks=(max(len(order), 1),), dtype="int64", fill_value=0)
        kg["order"][:] = order
        kg.create_array("offsets", shape=offsets.shape, chunks=(len(offsets),), dtype="int64", fill_value=0)
        kg["offsets"][:] = offsets
        kg.attrs.update(
            {
                "scheme": scheme,
                "params": params,
                "split": split,
                "crc": {"order": crc(order.astype(np.int64)), "offsets": crc(offsets.astype(np.int64))},
                "complete": True,
            }
        )
        return key

    def partition_keys(self) -> list[str]:
        if "partitions" not in self._g:
            return []
        pg = self._arr("partitions")
        return sorted(k for k, sub in pg.groups() if sub.attrs.get("complete"))

    def _partition_array(self, key: str, name: str, attrs: dict) -> np.ndarray:
        a = self._read(f"partitions/{key}/{name}").astype(np.int64)
        want = attrs.get("crc", {}).get(name)
        if want is not None and crc(a) != want:
            raise FedfeatError(
                f"store {self.path}: partitions/{key}/{name} does not match its checksum (chunk file missing "
                "or changed); make the partition again with `fedfeat partition` (it is recomputed exactly)"
            )
        return a

    def partition_info(self, key: str) -> dict:
        a = dict(self._arr(f"partitions/{key}").attrs)
        offs = self._partition_array(key, "offsets", a)
        return {**a, "clients": len(offs) - 1, "samples": int(offs[-1])}

    def partition_arrays(self, key: str) -> tuple[str, dict, np.ndarray, np.ndarray]:
        """The stored partition ``key`` as ``(scheme, params, order, offsets)`` (``fedfeat.partition.stored.read``
        makes a ``Partition`` of them)."""
        if key not in self.partition_keys():
            known = ", ".join(self.partition_keys()) or "none"
            raise FedfeatError(
                f"store {self.path} has no partition '{key}' (stored: {known}); "
                "create it with `fedfeat partition`"
            )
        a = dict(self._arr(f"partitions/{key}").attrs)
        order, offsets = (self._partition_array(key, k, a) for k in ("order", "offsets"))
        bad = _partition_problems(self, key, a, order, offsets)
        if bad:
            raise FedfeatError(
                f"store {self.path}: {bad[0]}; make the partition again with `fedfeat partition` (it is "
                "recomputed exactly)"
            )
        return a["scheme"], a["params"], order, offsets

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        """A plain dict for ``fedfeat info``: attributes, sizes on disk, partitions."""
        if isinstance(self.path, Path):
            size = sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        else:
            fs, p = url_filesystem(self.path)
            size = int(fs.du(p, total=True))
        return {
            "path": str(self.path),
            "attrs": self.attrs,
            "bytes_on_disk": size,
            "partitions": {k: self.partition_info(k) for k in self.partition_keys()},
        }


# ---------------------------------------------------------------------------------------- attributes vs arrays
def _rows_arg(rows) -> np.ndarray:
    """Row positions (``features_rows``, ``pixels``): a 1-D array-like of integers, else one line."""
    a = np.asarray(rows)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise FedfeatError(
            f"rows must be a 1-D sequence of integer row positions, got {_short(rows)}; e.g. np.arange(10)"
        )
    return a.astype(np.int64)


def _fs_of(loc: Path | str):
    if isinstance(loc, Path):
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(auto_mkdir=True), str(loc.absolute())
    return url_filesystem(loc)


def copy_store(src: str | Path, dst: str | Path, *, overwrite: bool = False, log=None) -> Path | str:
    """Copy the complete store ``src`` to ``dst`` (local paths or store URLs, e.g. a local store to ``s3://``).
    Every object is copied before the root ``zarr.json`` (which holds the store attributes and the complete flag):
    an interrupted copy is not a store, never a store that reads as complete. ``dst`` must not exist unless
    ``overwrite`` (a fedfeat store there, or a copy cut short, is replaced). Returns ``dst``'s location.

    Example::

        >>> copy_store("cache/synth-cifar10.zarr", "s3://bucket/synth-cifar10.zarr")   # doctest: +SKIP
        's3://bucket/synth-cifar10.zarr'
    """
    FeatureStore.open(src)  # complete and readable, or a one-line error
    s_loc, d_loc = store_location(path_arg(src, "src")), store_location(path_arg(dst, "dst"))
    refuse_dangling_link(d_loc)
    a, b = (str(x.resolve()) if isinstance(x, Path) else x.rstrip("/") for x in (s_loc, d_loc))
    if a == b or b.startswith(a + "/") or a.startswith(b + "/"):  # replacing dst would delete src
        raise FedfeatError(
            f"cannot copy store {s_loc} to {d_loc}: one holds the other; choose another destination"
        )
    if store_exists(d_loc):
        if not overwrite:
            raise FedfeatError(f"{d_loc} already exists; pass --force to replace it")
        if not is_store(d_loc) and not (
            group_meta(d_loc) is None and group_meta(f"{d_loc}/text") is not None
        ):
            raise FedfeatError(  # only a store, or a copy cut short (no root zarr.json), is ever deleted
                f"{d_loc} exists and is not a fedfeat store; choose another destination"
            )
        if isinstance(d_loc, Path) and d_loc.is_symlink():
            d_loc.unlink()  # the link only: the store it points to is not ours to delete
        else:
            dfs, dp = _fs_of(d_loc)
            dfs.rm(dp, recursive=True)
    sfs, sp = _fs_of(s_loc)
    dfs, dp = _fs_of(d_loc)
    files = sorted(f for f in sfs.find(sp) if not f.rsplit("/", 1)[-1].startswith(".write-probe-"))
    root = f"{sp.rstrip('/')}/zarr.json"
    try:
        for f in [f for f in files if f != root] + [root]:  # the root metadata (complete flag) last
            dfs.pipe_file(dp.rstrip("/") + f[len(sp.rstrip("/")) :], sfs.cat_file(f))
    except OSError as e:
        raise storage_error(
            e, d_loc, "copying the store", "check the destination and run the copy again"
        ) from None
    if log is not None:
        log(f"copied {s_loc} to {d_loc} ({len(files)} objects)")
    return d_loc


def normalize_pixels(px, mean, std):
    """uint8 model inputs ``[B, 3, H, W]`` (a torch tensor, any device) -> the model's float32 input, with exactly
    torchvision's ``ToTensor`` + ``Normalize`` arithmetic (``x / 255``, then ``(x - mean) / std`` per channel)."""
    import torch

    x = px.to(torch.float32).div(255)
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return x.sub_(m).div_(s)
