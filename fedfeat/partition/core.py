"""The result of a partition and its names and files: ``Partition`` (each client's sample positions, the scheme and
its parameters), ``partition_key`` (the short key a store keeps it under) and JSON export / import.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.registry import key_parts, plain_number

# ----------------------------------------------------------------------------------------- the result


@dataclass(frozen=True, eq=False)
class Partition:
    """A split's partition: ``clients[i]`` = int64 positions into the split, in client i's own order."""

    scheme: str
    params: dict  # every parameter (scheme, clients, alpha, shards, imbalance_factor, seed, ...); JSON-safe
    clients: list[np.ndarray]

    @property
    def n_clients(self) -> int:
        return len(self.clients)

    def sizes(self) -> np.ndarray:
        """Samples per client, int64 ``[clients]``."""
        return np.array([len(c) for c in self.clients], dtype=np.int64)

    def order_and_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """Client-major concatenation ``order`` int64 ``[M]`` and ``offsets`` int64 ``[clients + 1]``.

        Client i holds ``order[offsets[i]:offsets[i + 1]]`` (the storage layout: one client = one read).
        """
        offsets = np.zeros(self.n_clients + 1, dtype=np.int64)
        np.cumsum(self.sizes(), out=offsets[1:])
        order = np.concatenate(self.clients).astype(np.int64) if self.clients else np.zeros(0, np.int64)
        return order, offsets

    @classmethod
    def from_order_and_offsets(cls, scheme: str, params: dict, order, offsets) -> Partition:
        """Inverse of ``order_and_offsets``."""
        order = np.asarray(order, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        if (
            order.ndim != 1
            or offsets.ndim != 1
            or len(offsets) < 1
            or offsets[0] != 0
            or offsets[-1] != len(order)
            or np.any(np.diff(offsets) < 0)
        ):
            raise FedfeatError(
                f"partition '{scheme}' is corrupt: offsets must rise from 0 to len(order)={len(order)}; "
                "rebuild it (fedfeat partition) or delete it from the store"
            )
        return cls(scheme, dict(params), [order[a:b] for a, b in itertools.pairwise(offsets)])

    def counts(self, labels, n_classes: int) -> np.ndarray:
        """Samples per client and class, int64 ``[clients, classes]``."""
        labels = np.asarray(labels)
        order, offsets = self.order_and_offsets()
        owner = np.repeat(np.arange(self.n_clients), np.diff(offsets))
        flat = np.bincount(owner * n_classes + labels[order], minlength=self.n_clients * n_classes)
        return flat.reshape(self.n_clients, n_classes).astype(np.int64)

    def unassigned(self, n: int) -> np.ndarray:
        """Positions in ``0..n-1`` that no client holds (iid remainder, long-tail cut, Fed-MP's unused...)."""
        held = np.zeros(n, dtype=bool)
        held[self.order_and_offsets()[0]] = True
        return np.flatnonzero(~held)


_plain = plain_number  # a number as the int it is, or a float (JSON-safe, and '100' not '100.0' in keys)


def partition_key(partition_or_params) -> str:
    """Short readable storage key, unique per parameter set:
    ``[lt<IF>+][b2n+][shots<k>+]<scheme><parts>-c<clients>-s<seed><parts>``,
    the parts each scheme's ``key_parts`` (``fedfeat.partition.registry``; a name no scheme has: every scheme's).

    >>> partition_key({"scheme": "dirichlet-equal", "clients": 20, "alpha": 0.5, "imbalance_factor": 100,
    ...                "seed": 7})
    'lt100+dirichlet-equal-a0.5-c20-s7'
    """
    p = partition_or_params.params if isinstance(partition_or_params, Partition) else partition_or_params
    parts = key_parts(p["scheme"])

    def pieces(after: bool) -> str:
        return "".join(
            f"-{k.tag}{k.text(p[k.name])}" for k in parts if k.after == after and p.get(k.name) is not None
        )

    key = f"{p['scheme']}{pieces(False)}-c{int(p['clients'])}-s{int(p['seed'])}{pieces(True)}"
    if p.get("client_shots") is not None:
        key = f"shots{int(p['client_shots'])}+{key}"
    if p.get("base_novel"):
        key = f"b2n+{key}"
    if p.get("imbalance_factor") is not None:
        key = f"lt{_plain(p['imbalance_factor'])}+{key}"
    return key


def to_json(partition: Partition, path, store_fingerprint: str | None = None) -> None:
    """Write ``{"scheme", "params", "clients": [[position, ...], ...]}`` atomically (tmp file + rename), and
    ``"store_fingerprint"`` when given (``fedfeat partition --export``: ``train --partition FILE.json`` then refuses
    the file on another store; ``fedfeat.partition.external``)."""
    path = Path(path)
    doc = {
        "scheme": partition.scheme,
        "params": partition.params,
        "clients": [np.asarray(c).tolist() for c in partition.clients],
    }
    if store_fingerprint is not None:
        doc["store_fingerprint"] = store_fingerprint
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # dumps, then one write: json.dump encodes chunk by chunk in Python (5x
            f.write(json.dumps(doc, separators=(",", ":")))  # slower at 100,000 clients); the same text
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def from_json(path) -> Partition:
    """Read a file written by ``to_json``."""
    try:
        doc = json.loads(Path(path).read_text())
        return Partition(
            doc["scheme"], doc["params"], [np.asarray(c, dtype=np.int64) for c in doc["clients"]]
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FedfeatError(
            f"cannot read partition file {path}: {e}; pass a file written by --export"
        ) from None
