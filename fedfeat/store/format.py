"""The store format's version and the small pieces that both the store (``fedfeat.store.featurestore``) and its
attribute checks (``fedfeat.store.checks``) use."""

from __future__ import annotations

import hashlib
import json

FORMAT_VERSION = 2


def fingerprint_hash(fingerprint: dict) -> str:
    """A short stable hash of a fingerprint dict (canonical JSON, sha256)."""
    blob = json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def short(v, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


__all__ = ["FORMAT_VERSION", "fingerprint_hash", "short"]
