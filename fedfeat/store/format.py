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


def longtail_counts(classes: int, per_class: int, minimum: int):
    """Training images per class of a synthetic store (``fedfeat.store.synth.SynthParams``): ``per_class`` each where
    ``minimum`` is 0, else the exponential long tail of Cui et al. 2019 (CIFAR-LT's profile) from ``per_class``
    (class 0) down to ``minimum`` (class K - 1): ``round(per_class * (minimum / per_class) ** (k / (K - 1)))``."""
    import numpy as np

    if not minimum:
        return np.full(classes, per_class, dtype=np.int64)
    k = np.arange(classes) / max(classes - 1, 1)
    return np.maximum(np.round(per_class * (minimum / per_class) ** k), 1).astype(np.int64)
