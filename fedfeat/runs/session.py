"""What the runs of one process share: stores, partitions, loaded features and live text encoders.

Outside a ``session()`` block every run opens and loads its own; inside one (a sweep, ``reproduce``) each store,
partition, loaded split and live encoder is made once and reused by every run that reads the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from fedfeat.engine.data import check_labels
from fedfeat.errors import FedfeatError
from fedfeat.runs.config import RunConfig


@dataclass
class Session:
    """Caches shared by the runs of one process (``fedfeat.runs.train`` uses the active one)."""

    stores: dict = field(default_factory=dict)  # store path -> FeatureStore (read-only)
    partitions: dict = field(default_factory=dict)  # (store path, partition settings) -> (key, Partition)
    data: dict = field(default_factory=dict)  # (store path, partition key, load settings) -> RunData
    live: dict = field(default_factory=dict)  # (store path, device, pretrained) -> LiveText
    hits: int = 0


_ACTIVE: list[Session] = []


def active() -> Session | None:
    """The session of the innermost ``session()`` block, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def session():
    """Share stores, partitions and loaded features between the runs made inside the block."""
    s = Session()
    _ACTIVE.append(s)
    try:
        yield s
    finally:
        _ACTIVE.pop()


def open_store(cfg: RunConfig):
    """The run's store, read-only; a replayed config's store must have the recorded fingerprint."""
    from fedfeat.store.featurestore import FeatureStore
    from fedfeat.store.urls import canonical_store

    sess = active()
    where = canonical_store(cfg.store)  # an absolute local path, or the store's URL
    if sess is not None and where in sess.stores:  # a sweep: one open store (and its label check) per process
        store = sess.stores[where]
        sess.hits += 1
    else:
        store = FeatureStore.open(cfg.store, mode="r")
        check_labels(store)
        if sess is not None:
            store.memo = {}  # verified feature arrays kept for the session's other runs
            sess.stores[where] = store
    if cfg.preset is not None:
        from fedfeat.partition.openvocab import PRESETS

        want = PRESETS[cfg.preset]["classes"]
        if store.n_classes != want:
            raise FedfeatError(
                f"preset {cfg.preset} is for a store of {want} classes, {cfg.store} has {store.n_classes}; pass "
                "the store encoded from that dataset, or drop --preset"
            )
    from fedfeat.partition.openvocab import class_order_mode, preset_class_order

    if class_order_mode(cfg.class_order, cfg.preset) == "preset":  # its class names match the preset's list
        preset_class_order(cfg.preset, store.class_names)
    have = store.attrs.get("fingerprint_hash")
    if cfg.store_fingerprint is not None and have != cfg.store_fingerprint:
        raise FedfeatError(
            f"store {cfg.store} has fingerprint {have}, but the config was run on a store with fingerprint "
            f"{cfg.store_fingerprint}; pass --store to run it on this store anyway, or point it at the original"
        )
    cfg.store = where  # config.toml works from any working directory
    cfg.store_fingerprint = have
    return store


def run_partition(store, cfg: RunConfig, save: bool):
    """``(key, Partition, stored)``: computed in memory (the store is opened read-only); saved into the store
    only when asked (``--save-partition``) and the store is writable."""
    from fedfeat.partition import stored as stored_partition
    from fedfeat.partition.openvocab import class_order_mode, preset_class_order

    sess = active()
    order = None  # disjoint-classes drawn in the preset's class order (--class-order preset)
    if cfg.partition == "disjoint-classes" and class_order_mode(cfg.class_order, cfg.preset) == "preset":
        order = preset_class_order(cfg.preset, store.class_names)
    ck = (str(store.path), cfg.partition, cfg.clients, cfg.alpha, cfg.shards, cfg.imbalance_factor, cfg.shots,
          cfg.partition_seed, None if order is None else cfg.preset)  # fmt: skip
    if sess is not None and ck in sess.partitions:
        key, part = sess.partitions[ck]
    else:
        key, part = stored_partition.store_partition(
            store,
            scheme=cfg.partition,
            clients=cfg.clients,
            alpha=cfg.alpha,
            shards=cfg.shards,
            imbalance_factor=cfg.imbalance_factor,
            shots=cfg.shots,
            seed=cfg.partition_seed,
            save=False,
            class_order=order,
            class_order_name=None if order is None else cfg.preset,
        )
        if sess is not None:
            sess.partitions[ck] = (key, part)
    stored = key in store.partition_keys()
    if save and not stored:
        from fedfeat.store.featurestore import FeatureStore

        try:
            stored_partition.write(FeatureStore.open(cfg.store, mode="r+"), part, key=key)
        except OSError as e:
            raise FedfeatError(
                f"cannot save partition {key} into store {cfg.store}: {e.strerror}; drop --save-partition "
                "(the run keeps its partition in its own directory)"
            ) from None
        stored = True
    return key, part, stored


def run_data(store, part, key: str, cfg: RunConfig, device, centralized: bool):
    """``load_run_data`` for this run, shared with the other runs of a sweep that read the same data."""
    from fedfeat.engine.data import load_run_data

    sess = active()
    lv, qv, lt = cfg.local_val or "paper", cfg.query_val or "paper", cfg.local_test or "none"
    vs = cfg.val_split or 0.0
    ck = (str(store.path), key, str(device), centralized, lv, qv, lt, vs)
    if sess is not None and ck in sess.data:
        return sess.data[ck]
    data = load_run_data(
        store, part, device=device, centralized=centralized, local_val=lv, query_val=qv, local_test=lt,
        val_split=vs,
    )  # fmt: skip
    if sess is not None:
        data.memo = {}
        sess.data[ck] = data
    return data


def live_text(store, cfg: RunConfig, device):
    from fedfeat.encoders.live import load_live_text

    sess = active()
    ck = (str(store.path), str(device), cfg.pretrained)
    if sess is not None and ck in sess.live:
        return sess.live[ck]
    live = load_live_text(store, device=device, pretrained=cfg.pretrained)
    if sess is not None:
        sess.live[ck] = live
    return live
