"""``FeatureStore``'s verified reads (a mixin of ``fedfeat.store.featurestore.FeatureStore``): features, pixels,
labels and text features checked against the checksums recorded when they were written and for finite values, and
``verify`` (``fedfeat info --verify``), which checks everything."""

from __future__ import annotations

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.store.checksums import DONE_BIT, crc
from fedfeat.store.format import short as _short


class StoreReading:
    """``FeatureStore``'s reads, each verified (the store's ``_read``, ``_damaged``, chunk layout ... are the
    class's)."""

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

    def domains(self, split: str) -> np.ndarray | None:
        """``[N]`` int64 index into ``domain_names`` of every row of ``split`` (multi-domain stores), checked against
        its checksum; None for a store without domains."""
        self._check_split(split)
        if self._attrs.get("domain_names") is None:
            return None
        dom = self._read(f"{split}/domains")
        entry = int(self._read(f"{split}/domains_crc")[0])
        if entry != DONE_BIT | crc(np.ascontiguousarray(dom, dtype=np.int16)):
            raise self._damaged(
                f"{split}/domains (rows 0-{len(dom) - 1}) does not match its checksum "
                "(chunk file missing, truncated or changed)"
            )
        return dom.astype(np.int64)

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
            self.domains(split)
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


def _rows_arg(rows) -> np.ndarray:
    """Row positions (``features_rows``, ``pixels``): a 1-D array-like of integers, else one line."""
    a = np.asarray(rows)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise FedfeatError(
            f"rows must be a 1-D sequence of integer row positions, got {_short(rows)}; e.g. np.arange(10)"
        )
    return a.astype(np.int64)
