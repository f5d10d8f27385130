"""The feature store: one zarr v3 directory per dataset x backbone x weights.

Layout (``FORMAT_VERSION`` 2)::

    STORE.zarr/                      group attrs: see ``REQUIRED_ATTRS`` (+ "complete", "finite", "fingerprint_hash")
      <split>/features  [N, D] float16   unnormalised embeddings, row chunks of >= 1 MiB, zstd-1
      <split>/labels    [N]    int64     class ids; -1 marks a row skipped as unreadable (``encode --skip-bad``)
      <split>/labels_crc [1]   uint64    DONE_BIT | crc32 of the labels' bytes
      <split>/domains   [N]    int16     optional (multi-domain datasets, attribute "domain_names"): each row's index
                                         into domain_names; written with the labels at create time
      <split>/domains_crc [1]  uint64    DONE_BIT | crc32 of the domains' bytes
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

Modules: ``FeatureStore`` is this module's class (creating, opening, the attributes, ``summary``), with its
methods by concern in mixins: ``fedfeat.store.writing`` (chunked writing, ``mark_complete``),
``fedfeat.store.reading`` (verified reads, ``verify``) and ``fedfeat.store.partition_arrays`` (stored partitions);
the checksums are ``fedfeat.store.checksums``, path arguments, modes and what ``create`` may replace
``fedfeat.store.paths``, the attribute-against-array checks ``fedfeat.store.checks``. Where a store is (paths,
fsspec URLs) is ``fedfeat.store.urls``; its writer lock ``fedfeat.store.lock``. Every name here before the split
(``crc``, ``DONE_BIT``, ``path_arg``, ``default_chunk_rows`` ...) is still importable from this module.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from fedfeat.errors import FedfeatError
from fedfeat.store import quiet_exit
from fedfeat.store.checks import AttrCheck as _AttrCheck
from fedfeat.store.checksums import DONE_BIT, crc, first_nonfinite_row  # noqa: F401  (re-exported)
from fedfeat.store.format import FORMAT_VERSION, fingerprint_hash  # noqa: F401  (re-exported)
from fedfeat.store.format import short as _short
from fedfeat.store.partition_arrays import StorePartitions
from fedfeat.store.paths import (  # noqa: F401  (re-exported)
    MODES,
    _clear_target,
    check_mode,
    half_created,
    path_arg,
    refuse_dangling_link,
)
from fedfeat.store.reading import StoreReading
from fedfeat.store.urls import (
    group_meta,
    is_store,
    storage_error,
    store_exists,
    store_location,
    url_filesystem,
)
from fedfeat.store.writing import MIN_CHUNK_BYTES, StoreWriting, default_chunk_rows  # noqa: F401  (re-exported)

quiet_exit.install()  # a Ctrl-C during a read ends without zarr's asyncio noise (fedfeat.store.quiet_exit)

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


class FeatureStore(StoreWriting, StoreReading, StorePartitions):
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
        domains: dict[str, np.ndarray] | None = None,
        domain_names: list[str] | None = None,
    ) -> FeatureStore:
        """Create an empty, incomplete store with its labels written and its feature chunks pending.

        ``labels`` maps each split name ("train", "test", ...) to its ``[N]`` label array; the
        feature arrays are pre-sized (one process creates, writers only fill whole chunks).
        ``sources``: ``{file name: [size, content hash]}`` of the dataset files (``encode``).
        ``pixels``: ``{"size": [H, W], "mean": [3], "std": [3]}`` to also keep every image as the model's uint8 input
        after its resize and centre crop (``encode --pixels``; live image methods read them).
        ``domain_names`` and ``domains`` (``{split: [N] ints into domain_names}``, every split): each row's domain
        (multi-domain datasets); stores without them have neither the attribute nor the arrays.
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
        if domain_names is not None:
            doms = _domain_arrays(domains, domain_names, labels)
            attrs["domain_names"] = [str(d) for d in domain_names]
        elif domains is not None:
            raise FedfeatError("domains were given without domain_names; pass both or neither")
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
            if domain_names is not None:
                sg.create_array("domains", shape=(n,), chunks=(n,), dtype="int16", fill_value=-1)
                sg.create_array("domains_crc", shape=(1,), chunks=(1,), dtype="uint64", fill_value=0)
                st._write_domains(split, doms[split])
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
        if self._attrs.get("dataset") == "combined":
            return "`fedfeat combine --overwrite` from its source stores"
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
    def domain_names(self) -> list[str] | None:
        """The domains of a multi-domain store (``domains(split)`` indexes them); None for other stores."""
        names = self._attrs.get("domain_names")
        return list(names) if names is not None else None

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


def _domain_arrays(domains, names, labels: dict) -> dict[str, np.ndarray]:
    """``domains`` checked against ``names`` and the splits: ``{split: [N] int16}``, else one line."""
    if not (isinstance(names, (list, tuple)) and names and all(isinstance(d, str) and d for d in names)):
        raise FedfeatError(f"domain_names must be a non-empty list of names, got {_short(names)}")
    if len(names) > np.iinfo(np.int16).max:
        raise FedfeatError(f"{len(names)} domains; a store records at most {np.iinfo(np.int16).max}")
    if not isinstance(domains, dict) or set(domains) != set(labels):
        have = sorted(domains) if isinstance(domains, dict) else _short(domains)
        raise FedfeatError(
            f"domains must give every split ({', '.join(labels)}) its rows' domains, got {have}"
        )
    out = {}
    for split, lab in labels.items():
        d = np.asarray(domains[split])
        if d.shape != (len(lab),) or (d.size and d.dtype.kind not in "iu"):
            raise FedfeatError(
                f"domains of split '{split}' must be {len(lab)} integers, got shape {list(d.shape)}"
            )
        if d.size and (d.min() < 0 or d.max() >= len(names)):
            raise FedfeatError(
                f"domains of split '{split}' hold ids outside 0..{len(names) - 1} (the domain_names)"
            )
        out[split] = d.astype(np.int16)
    return out


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
    """uint8 model inputs ``[B, 3, H, W]`` -> the model's float32 input (``fedfeat.encoders.feed.normalize_pixels``:
    torchvision's ``ToTensor`` + ``Normalize`` arithmetic)."""
    from fedfeat.encoders.feed import normalize_pixels as norm

    return norm(px, mean, std)


def publish(out: Path, write, what: str, fix: str) -> None:
    """Write a whole store at ``out`` crash-safely: ``write(tmp)`` fills a temporary sibling (``.<name>.tmp-<pid>``),
    which replaces ``out`` only once complete (an old store at ``out`` goes last). A failure (a full disk, Ctrl-C)
    leaves nothing at ``out`` that looks like a store; a filesystem error is a one-line ``FedfeatError`` naming
    ``what`` was being written and ``fix``."""
    import os
    import shutil

    from fedfeat.store.urls import storage_error

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        if out.is_dir() and not out.is_symlink():  # the old store goes only once the new one is complete
            os.replace(out, old)
        elif out.exists() or out.is_symlink():
            out.unlink()
        os.replace(tmp, out)
    except OSError as e:
        raise storage_error(e, out, what, fix) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def existing_store(out: Path, fingerprint: dict, force: bool, flag: str, where: str, replaceable):
    """What is at ``out`` before a whole store is written there: the complete store of this ``fingerprint`` (kept:
    returned), nothing or a replaceable leftover (None: write it), another store (``force``: None, else a one-line
    error naming ``flag``), or files fedfeat did not write (``replaceable(out)`` false: a one-line error, never
    deleted). ``where`` names the output option in messages."""
    refuse_dangling_link(out)
    if not out.exists():
        return None
    from fedfeat.store.urls import is_store

    if is_store(out):
        st = None
        try:
            st = FeatureStore.open(out, allow_incomplete=True)
        except FedfeatError:
            if not force:  # a damaged or older-format store: its message says how to rebuild it
                raise
        if st is not None and st.complete:
            if st.attrs.get("fingerprint_hash") == fingerprint_hash(fingerprint):
                return st
            if not force:
                raise FedfeatError(
                    f"{out} holds a different store; pass {flag} to replace it, or choose {where}"
                )
        return None
    if not replaceable(out):  # never delete what fedfeat did not write, even when forced
        raise FedfeatError(
            f"{out} exists and is not a fedfeat store; choose {where} (or move it away yourself: {flag} replaces "
            "stores only)"
        )
    return None
