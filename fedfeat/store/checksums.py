"""The store's checksums: a crc32 of every chunk's, the labels' and the text features' bytes, kept in a done entry
as ``DONE_BIT | crc32`` (never 0, zarr's fill value for a missing entry), and the scan for non-finite rows that
every write and verified read runs (``fedfeat.store.featurestore`` describes the format)."""

from __future__ import annotations

import zlib

import numpy as np

DONE_BIT = 1 << 32  # a done entry is DONE_BIT | crc32: never 0 (zarr's fill value for a missing entry)
_F16_EXP = np.uint16(0x7C00)  # float16 exponent bits: all set means inf or NaN


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
