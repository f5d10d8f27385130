"""``FeatureStore``'s chunked writing (a mixin of ``fedfeat.store.featurestore.FeatureStore``): feature chunks written
whole, each then recorded as done with its checksum; labels, text features, attributes, and ``complete`` set last
once nothing is pending. Also the feature chunks' size (``default_chunk_rows``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.store.checksums import DONE_BIT, crc, first_nonfinite_row

MIN_CHUNK_BYTES = 1 << 20  # a feature chunk is at least 1 MiB (fewer, larger files; zarr reads whole chunks)


def default_chunk_rows(embed_dim: int) -> int:
    """Rows per feature chunk: the smallest power of two whose float16 chunk is >= 1 MiB."""
    rows = MIN_CHUNK_BYTES / (2 * embed_dim)
    return 1 << max(0, math.ceil(math.log2(rows)))


class StoreWriting:
    """``FeatureStore``'s chunk layout and writes (the store's ``_g``, ``_attrs``, ``_read`` ... are the class's)."""

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

    def _write_domains(self, split: str, domains: np.ndarray) -> None:
        domains = np.ascontiguousarray(domains, dtype=np.int16)
        self._g[f"{split}/domains"][:] = domains
        self._g[f"{split}/domains_crc"][0] = DONE_BIT | crc(domains)

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
