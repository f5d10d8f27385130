"""The feature store: one zarr v3 directory per dataset x backbone x weights.

Layout (``FORMAT_VERSION`` 1)::

    STORE.zarr/                      group attrs: see ``REQUIRED_ATTRS`` (+ "complete", "fingerprint_hash")
      <split>/features  [N, D] float16   unnormalised embeddings, row chunks of >= 1 MiB, zstd-1
      <split>/labels    [N]    int64     class ids; -1 marks a row skipped as unreadable (``encode --skip-bad``)
      <split>/done      [n_chunks] uint8 1 once that feature chunk is written whole (one file per chunk)
      text/features     [T, K, D] float16  one class embedding per template x class
      text/done         [1] uint8
      partitions/<key>/order    [M] int64   client-major sample positions into the split
      partitions/<key>/offsets  [clients + 1] int64   client i holds order[offsets[i]:offsets[i+1]]
                                            attrs: scheme, params (incl. seed), split

Crash safety: a writer fills a whole feature chunk, then sets its ``done`` entry; the group's
``complete`` attribute is set last, after every chunk and the text embeddings are done. ``open``
refuses a store whose ``complete`` flag is not set. Several processes may write at once as long as
each owns whole chunks (zarr silently loses data when two writers share a chunk).

Example::

    >>> st = FeatureStore.open("cache/synth-cifar10.zarr")
    >>> st.features("train").shape, st.class_names[:2]
    ((50000, 1024), ['airplane', 'automobile'])
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from fedfeat.errors import FedfeatError

FORMAT_VERSION = 1
MIN_CHUNK_BYTES = 1 << 20  # a feature chunk is at least 1 MiB (fewer, larger files; zarr reads whole chunks)

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


def fingerprint_hash(fingerprint: dict) -> str:
    """A short stable hash of a fingerprint dict (canonical JSON, sha256)."""
    blob = json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_chunk_rows(embed_dim: int) -> int:
    """Rows per feature chunk: the smallest power of two whose float16 chunk is >= 1 MiB."""
    rows = MIN_CHUNK_BYTES / (2 * embed_dim)
    return 1 << max(0, math.ceil(math.log2(rows)))


def is_store(path: str | Path) -> bool:
    """True when ``path`` holds a fedfeat store (complete or not)."""
    p = Path(path)
    meta = p / "zarr.json"
    if not meta.is_file():
        return False
    try:
        attrs = json.loads(meta.read_text()).get("attributes", {})
    except (OSError, ValueError):
        return False
    return "format_version" in attrs


class FeatureStore:
    """A fedfeat feature store on disk. Use ``create`` to start one and ``open`` to read one."""

    def __init__(self, path: Path, group: zarr.Group):
        self.path = path
        self._g = group
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
        overwrite: bool = False,
    ) -> FeatureStore:
        """Create an empty, incomplete store with its labels written and its feature chunks pending.

        ``labels`` maps each split name ("train", "test", ...) to its ``[N]`` label array; the
        feature arrays are pre-sized (one process creates, writers only fill whole chunks).
        """
        path = Path(path)
        if path.exists():
            if not overwrite:
                raise FedfeatError(f"{path} already exists; pass --force to replace it")
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
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
            la = sg.create_array("labels", shape=(n,), chunks=(max(n, 1),), dtype="int64", fill_value=-1)
            la[:] = lab
            sg.create_array(
                "done", shape=(math.ceil(n / chunk_rows),), chunks=(1,), dtype="uint8", fill_value=0
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
        tg.create_array("done", shape=(1,), chunks=(1,), dtype="uint8", fill_value=0)
        g.require_group("partitions")
        g.attrs.update(
            attrs
        )  # attributes last: a half-created store has no format_version and is "not a store"
        return cls(path, g)

    @classmethod
    def open(cls, path: str | Path, *, mode: str = "r", allow_incomplete: bool = False) -> FeatureStore:
        """Open an existing store; refuse paths that are not stores, other format versions and
        (unless ``allow_incomplete``) stores whose writing never finished."""
        path = Path(path)
        if not path.exists():
            raise FedfeatError(
                f"no store at {path}; create one with `fedfeat synth --out {path}` or `fedfeat encode`"
            )
        if not is_store(path):
            raise FedfeatError(
                f"{path} is not a fedfeat store (no store attributes in zarr.json); "
                "point to a directory made by `fedfeat synth` or `fedfeat encode`"
            )
        g = zarr.open_group(str(path), mode=mode, zarr_format=3)
        st = cls(path, g)
        version = st._attrs.get("format_version")
        if version != FORMAT_VERSION:
            raise FedfeatError(
                f"{path} has store format version {version}, this fedfeat reads version {FORMAT_VERSION}; "
                "rebuild it with this version's `fedfeat encode --force` (or `fedfeat synth --force`)"
            )
        if not allow_incomplete and not st.complete:
            raise FedfeatError(
                f"{path} is incomplete (its writing was interrupted); re-run the same `fedfeat encode` "
                "command to resume it, or `fedfeat synth --force` for a synthetic store"
            )
        return st

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
        if split not in self._attrs["splits"]:
            raise FedfeatError(f"store {self.path} has no split '{split}'; it has: {', '.join(self.splits)}")

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

    def done_chunks(self, split: str) -> np.ndarray:
        """``[n_chunks]`` bool: which feature chunks are written whole."""
        self._check_split(split)
        return self._g[f"{split}/done"][:].astype(bool)

    def write_chunk(self, split: str, i: int, feats: np.ndarray) -> None:
        """Write feature chunk ``i`` whole (``feats  # [rows, D]``), then record it as done."""
        sl = self.chunk_slice(split, i)
        feats = np.asarray(feats)
        if feats.shape != (sl.stop - sl.start, self.embed_dim):
            raise ValueError(
                f"chunk {i} of {split} needs shape {(sl.stop - sl.start, self.embed_dim)}, got {feats.shape}"
            )
        self._g[f"{split}/features"][sl] = feats.astype(np.float16)
        self._g[f"{split}/done"][i] = 1

    def set_labels(self, split: str, rows: slice, labels: np.ndarray) -> None:
        """Overwrite labels of ``rows`` (used to mark unreadable images with -1)."""
        self._g[f"{split}/labels"][rows] = np.asarray(labels, dtype=np.int64)

    def write_text(self, feats: np.ndarray) -> None:
        """Write the class-prompt embeddings ``feats  # [T, K, D]`` and record them as done."""
        want = (len(self.templates), self.n_classes, self.embed_dim)
        if tuple(feats.shape) != want:
            raise ValueError(f"text features need shape {want}, got {tuple(feats.shape)}")
        self._g["text/features"][:] = np.asarray(feats).astype(np.float16)
        self._g["text/done"][0] = 1

    def text_done(self) -> bool:
        return bool(self._g["text/done"][0])

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
        self.update_attrs(complete=True)

    # ------------------------------------------------------------------ reading
    def features(self, split: str) -> np.ndarray:
        """All features of ``split``: ``[N, D]`` float16, unnormalised."""
        self._check_split(split)
        return self._g[f"{split}/features"][:]

    def features_rows(self, split: str, rows: np.ndarray) -> np.ndarray:
        """Features of the given rows only (reads only the chunks holding them)."""
        self._check_split(split)
        rows = np.asarray(rows, dtype=np.int64)
        return self._g[f"{split}/features"].get_orthogonal_selection((rows, slice(None)))

    def labels(self, split: str) -> np.ndarray:
        """``[N]`` int64 labels of ``split`` (-1: row skipped as unreadable)."""
        self._check_split(split)
        return self._g[f"{split}/labels"][:]

    def text_features(self) -> np.ndarray:
        """``[T, K, D]`` float16 class-prompt embeddings, unnormalised."""
        return self._g["text/features"][:]

    # ------------------------------------------------------------------ partitions
    def save_partition(self, partition, split: str = "train", key: str | None = None) -> str:
        """Store a ``fedfeat.partition.Partition`` of ``split`` under ``partitions/<key>``."""
        from fedfeat.partition import partition_key

        self._check_split(split)
        key = key or partition_key(partition)
        order, offsets = partition.order_and_offsets()
        pg = self._g.require_group("partitions")
        if key in pg:
            del pg[key]
        kg = pg.require_group(key)
        kg.create_array("order", shape=order.shape, chunks=(max(len(order), 1),), dtype="int64", fill_value=0)
        kg["order"][:] = order
        kg.create_array("offsets", shape=offsets.shape, chunks=(len(offsets),), dtype="int64", fill_value=0)
        kg["offsets"][:] = offsets
        kg.attrs.update(
            {"scheme": partition.scheme, "params": partition.params, "split": split, "complete": True}
        )
        return key

    def partition_keys(self) -> list[str]:
        if "partitions" not in self._g:
            return []
        pg = self._g["partitions"]
        return sorted(k for k in pg.group_keys() if pg[k].attrs.get("complete"))

    def partition_info(self, key: str) -> dict:
        kg = self._g[f"partitions/{key}"]
        offs = kg["offsets"][:]
        return {**dict(kg.attrs), "clients": len(offs) - 1, "samples": int(offs[-1])}

    def load_partition(self, key: str):
        """The stored partition ``key`` as a ``fedfeat.partition.Partition``."""
        from fedfeat.partition import Partition

        if key not in self.partition_keys():
            known = ", ".join(self.partition_keys()) or "none"
            raise FedfeatError(
                f"store {self.path} has no partition '{key}' (stored: {known}); "
                "create it with `fedfeat partition`"
            )
        kg = self._g[f"partitions/{key}"]
        a = dict(kg.attrs)
        return Partition.from_order_and_offsets(a["scheme"], a["params"], kg["order"][:], kg["offsets"][:])

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        """A plain dict for ``fedfeat info``: attributes, sizes on disk, partitions."""
        size = sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        return {
            "path": str(self.path),
            "attrs": self.attrs,
            "bytes_on_disk": size,
            "partitions": {k: self.partition_info(k) for k in self.partition_keys()},
        }
