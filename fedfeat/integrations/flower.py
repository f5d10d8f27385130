"""Flower: a fedfeat partition as a flwr-datasets ``Partitioner``, and a client's cached features for a ``ClientApp``.

A Flower app then trains on exactly fedfeat's clients, and reads their features from the same store fedfeat
trains on (the cache shared by both worlds). Needs the optional extra ``pip install fedfeat[flower]``
(``flwr-datasets``; the example app ``examples/flower_app.py`` also needs ``flwr[simulation]``).

Clients over the raw rows (images, text) of a Hugging Face dataset::

    from datasets import load_from_disk
    from fedfeat.integrations.flower import FedfeatPartitioner

    part = FedfeatPartitioner.from_store("cache/cifar10/RN50-openai.zarr", "dirichlet-a0.1-c100-s19940817")
    part.dataset = load_from_disk("data/cifar10")["train"]    # the split the store encoded, in the same order
    client_7 = part.load_partition(7)                           # datasets.Dataset: exactly fedfeat's client 7

or through ``flwr_datasets.FederatedDataset(dataset=..., partitioners={"train": part})``. The partition is the
key of one stored with ``fedfeat partition STORE ...``, a file written by ``fedfeat partition ... --export FILE``
(``FedfeatPartitioner.from_json``), or a ``fedfeat.partition.Partition``. Client ``i`` is the dataset's rows
``partition.clients[i]`` (positions into the split, in fedfeat's client order); a dataset of the wrong length is
refused, and ``label_column`` (with a store) checks each client's labels against the store's.

Clients over cached features (``ClientApp`` code; no flwr-datasets needed)::

    from fedfeat.integrations.flower import client_features
    x, y = client_features("cache/cifar10/RN50-openai.zarr", "dirichlet-a0.1-c100-s19940817", 7, as_torch=True)

reads only the store chunks that hold client 7's rows (checked against their checksums).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition import stored
from fedfeat.partition.core import Partition, from_json
from fedfeat.partition.registry import SCHEMES
from fedfeat.store.featurestore import FeatureStore

__all__ = [  # and FedfeatPartitioner (made on first use: flwr-datasets is optional)
    "client_features",
    "client_rows",
    "load_partition",
    "split_features",
    "text_features",
]

EXTRA = "flower"


def _require_flwr_datasets():
    try:
        from flwr_datasets.partitioner import Partitioner
    except ImportError as e:
        raise FedfeatError(
            f"the Flower adapter needs flwr-datasets ({e.name or 'flwr_datasets'} is not installed); "
            f"pip install 'fedfeat[{EXTRA}]'"
        ) from None
    return Partitioner


def _no_test_rows(part: Partition, fix: str) -> FedfeatError:
    """A partition without per-client test rows: the schemes that draw them are the registry's."""
    drawing = [n for n, cls in SCHEMES.items() if cls.uses_test_labels]
    return FedfeatError(
        f"partition {part.scheme} has no per-client test rows (only {' / '.join(drawing)} draw them with the test "
        f"split); {fix}, or partition with --scheme {drawing[0]}"
    )


def _open(store):
    """A ``FeatureStore`` (opened read-only when given as a path or URL)."""
    if isinstance(store, (str, Path)):
        return FeatureStore.open(store, mode="r")
    return store


def load_partition(partition, store=None):
    """A ``fedfeat.partition.Partition`` from what users have at hand, and the split it partitions.

    ``partition``: a ``Partition``; a key stored in ``store`` (``fedfeat partition STORE ...`` prints it); or the
    path of a JSON file written by ``fedfeat partition ... --export FILE``. Returns ``(partition, split)``; the
    split is the stored partition's, or ``params["split"]`` / ``"train"`` otherwise."""
    if isinstance(partition, Partition):
        return partition, partition.params.get("split", "train")
    if not isinstance(partition, (str, Path)):
        raise FedfeatError(
            f"partition must be a stored key, an exported JSON file or a fedfeat.partition.Partition, not "
            f"{type(partition).__name__}"
        )
    st = _open(store) if store is not None else None
    if isinstance(partition, str) and st is not None and partition in st.partition_keys():
        return stored.read(st, partition), st.partition_info(partition).get("split", "train")
    path = Path(partition)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise FedfeatError(
                f"partition file {path} does not exist; write it with `fedfeat partition STORE ... --export {path}`"
            )
        p = from_json(path)
        return p, p.params.get("split", "train")
    where = (
        f" in store {st.path} (stored: {', '.join(st.partition_keys()) or 'none'})" if st is not None else ""
    )
    raise FedfeatError(
        f"no partition {partition!r}{where}; pass a stored key (make it with `fedfeat partition STORE ...`), a file "
        "from `fedfeat partition ... --export FILE`, or a fedfeat.partition.Partition"
    )


def _client(partition, client: int) -> int:
    n = partition.n_clients
    try:
        i = int(client)
    except (TypeError, ValueError):
        i = -1
    if i != client or not 0 <= i < n:
        raise FedfeatError(f"client {client!r} is not in this partition of {n} clients; pass 0..{n - 1}")
    return i


def client_rows(store, partition, client: int, *, test: bool = False) -> tuple[np.ndarray, str]:
    """Client ``client``'s rows of the store's split (int64, fedfeat's client order) and that split's name.

    ``test=True``: the client's local test rows of a partition drawn with the test split (e.g. ``dirichlet-joint``,
    FedCoPL), in the test split."""
    part, split = load_partition(partition, store)
    i = _client(part, client)
    if not test:
        return np.asarray(part.clients[i], dtype=np.int64), split
    tc = part.params.get("test_clients")
    if tc is None:
        raise _no_test_rows(part, "pass test=False")
    return np.asarray(tc[i], dtype=np.int64), "test"


def _out(x: np.ndarray, y: np.ndarray, normalize: bool, as_torch: bool, device):
    x = x.astype(np.float32)  # stored float16: compute in float32
    if normalize:
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    if not as_torch:
        return x, y
    import torch

    return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


def client_features(
    store, partition, client: int, *, test: bool = False, normalize: bool = False, as_torch: bool = False,
    device="cpu",
):  # fmt: skip
    """Client ``client``'s cached features ``[n, D]`` float32 and labels ``[n]`` int64 (numpy, or torch tensors on
    ``device`` with ``as_torch``): for a Flower ``ClientApp``'s local training on fedfeat's client of the same id.

    ``store``: a path, a URL or a ``FeatureStore``; ``partition``: a stored key, an exported JSON file or a
    ``Partition`` (see ``load_partition``). Reads only the chunks holding the client's rows. ``normalize``: L2-
    normalised rows (CLIP's cosine geometry, what fedfeat's methods train on by default); ``test``: the client's
    local test rows of a ``dirichlet-joint`` partition."""
    st = _open(store)
    rows, split = client_rows(st, partition, client, test=test)
    x = st.features_rows(split, rows)
    y = st.labels(split)[rows]
    return _out(x, y, normalize, as_torch, device)


def split_features(
    store, split: str = "test", *, normalize: bool = False, as_torch: bool = False, device="cpu"
):
    """A whole split's features ``[N, D]`` float32 and labels ``[N]`` (rows with label -1, images skipped at
    encode time, left out): a Flower ``ServerApp``'s centralised evaluation on the store's test split."""
    st = _open(store)
    y = st.labels(split)
    keep = y >= 0
    return _out(st.features(split)[keep], y[keep], normalize, as_torch, device)


def text_features(store, template: int | None = 0) -> np.ndarray:
    """The store's class-prompt embeddings ``[K, D]`` float32, L2-normalised: template ``template``, or the mean
    of all templates renormalised (CLIP's prompt ensemble) with ``None``; a zero-shot head to start from."""
    t = _open(store).text_features().astype(np.float32)  # [T, K, D]
    t /= np.linalg.norm(t, axis=-1, keepdims=True)
    t = t.mean(0) if template is None else t[template]
    return t / np.linalg.norm(t, axis=-1, keepdims=True)


_CLASS: list = []


def _partitioner_class():
    if _CLASS:
        return _CLASS[0]
    Partitioner = _require_flwr_datasets()

    class FedfeatPartitioner(Partitioner):
        """A flwr-datasets ``Partitioner`` whose partitions are a fedfeat partition's clients.

        ``load_partition(i)`` is ``dataset.select(partition.clients[i])``: the dataset's rows of fedfeat's client
        ``i``, in fedfeat's order; ``num_partitions`` is the number of clients. The dataset must be the split the
        store encoded, in the order it was encoded (the store's row ``r`` = the dataset's row ``r``). With
        ``label_column`` and a store, every loaded client's labels are checked against the store's (a dataset in
        another order, or with other class ids, is refused); with a store, the dataset's length is checked too.

        Build it with ``FedfeatPartitioner.from_store(store, key)``, ``FedfeatPartitioner.from_json(file)``, or
        ``FedfeatPartitioner(partition)``; ``test=True`` partitions the test split with a ``dirichlet-joint``
        partition's per-client test rows (FedCoPL's local test sets).
        """

        def __init__(
            self, partition, *, store=None, split: str | None = None, label_column: str | None = None,
            test: bool = False,
        ):  # fmt: skip
            super().__init__()
            if label_column is not None and store is None:
                raise FedfeatError(
                    "label_column checks each client's labels against the store's: pass store= too, or drop it"
                )
            self._store = _open(store) if store is not None else None
            part, psplit = load_partition(partition, self._store)
            self.partition = part
            if test:
                tc = part.params.get("test_clients")
                if tc is None:
                    raise _no_test_rows(part, "drop test=True")
                self._clients = [np.asarray(t, dtype=np.int64) for t in tc]
                psplit = "test"
            else:
                self._clients = [np.asarray(c, dtype=np.int64) for c in part.clients]
            self.split = split or psplit
            self.label_column = label_column
            self._labels = None
            self._checked_len = False

        @classmethod
        def from_store(cls, store, key: str, *, label_column: str | None = None, test: bool = False):
            """The partition stored in ``store`` under ``key`` (``fedfeat partition STORE ...`` prints the key)."""
            st = _open(store)
            if key not in st.partition_keys():
                load_partition(key, st)  # raises the one-line error listing the stored keys
            return cls(key, store=st, label_column=label_column, test=test)

        @classmethod
        def from_json(cls, path, *, store=None, label_column: str | None = None, test: bool = False):
            """A partition exported with ``fedfeat partition STORE ... --export FILE``."""
            from fedfeat.partition.core import from_json

            return cls(from_json(path), store=store, label_column=label_column, test=test)

        @property
        def num_partitions(self) -> int:
            return len(self._clients)

        def partition_indices(self, partition_id: int) -> np.ndarray:
            """The dataset rows of client ``partition_id`` (int64, fedfeat's client order)."""
            return self._clients[_client(self.partition, partition_id)]

        def _check_length(self) -> None:
            if self._checked_len:
                return
            n = len(self.dataset)
            need = self._store.n(self.split) if self._store is not None else None
            top = max((int(c.max()) for c in self._clients if len(c)), default=-1)
            if (need is not None and n != need) or top >= n:
                want = (
                    f"{need} rows (the store's {self.split} split)" if need is not None else f"> {top} rows"
                )
                raise FedfeatError(
                    f"the dataset has {n} rows but this fedfeat partition needs {want}; assign the split the store "
                    "encoded, in the order it was encoded"
                )
            self._checked_len = True

        def load_partition(self, partition_id: int):
            """The ``datasets.Dataset`` rows of fedfeat's client ``partition_id``."""
            rows = self.partition_indices(partition_id)
            self._check_length()
            out = self.dataset.select(rows)
            if self.label_column is not None and self._store is not None:
                if self._labels is None:
                    self._labels = self._store.labels(self.split)
                got = np.asarray(out[self.label_column], dtype=np.int64)
                bad = np.flatnonzero(got != self._labels[rows])
                if len(bad):
                    r = int(rows[bad[0]])
                    raise FedfeatError(
                        f"dataset row {r} has {self.label_column}={int(got[bad[0]])} but the store's {self.split} "
                        f"row {r} has label {int(self._labels[r])}: the dataset is not the split the store encoded "
                        "(or not in its order); assign that split, or drop label_column"
                    )
            return out

    FedfeatPartitioner.__module__ = __name__
    _CLASS.append(FedfeatPartitioner)
    return FedfeatPartitioner


def __getattr__(name: str):
    if name == "FedfeatPartitioner":  # built on first use: flwr-datasets is an optional extra
        return _partitioner_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
