"""What the runs of one process share: stores, partitions, loaded features and live text encoders.

Outside a ``session()`` block every run opens and loads its own; inside one (a sweep, ``reproduce``) each store,
partition, loaded split and live encoder is made once and reused by every run that reads the same.

**Memory follows the largest cell, not the grid** (issue 30). A sweep knows all its runs before it starts, so the
session releases each cached item after the *last* run that uses it (not a byte-bounded LRU: last-use release is
exact, needs no size guess, and never reloads what a later run will read again). ``Session.expect(cfgs)`` counts
the planned uses of each item's *signature* -- a key computed from the config alone (``signatures``: the store's
canonical location; + the partition settings; + the load settings; the live encoder's store, device, weights);
each cached entry is tagged with the signatures of the runs that read it. ``Session.done(cfg)`` (after a run, or
after a stack of runs: they share one copy) counts one use down, and drops every entry whose signatures all have no
use left (then ``gc.collect()`` once when that frees at least ``GC_MIN_BYTES``, so cyclic references free the
tensors at once). Signatures are coarser than
or equal to the cache keys: an entry is never dropped while a planned run still reads it; a run whose entry was
dropped (only possible when its signature differs from the one that made it) reloads it -- the same values. An
entry no plan counts (a session without ``expect``, a ``reproduce`` check before its sweep) is kept to the
session's end, as before. A store's memo of whole feature arrays (read and verified once for all the cells of that
store) is emptied as soon as the last planned cell of the store has loaded its features (``Session.loaded``), not
at the store's last run: a grid that visits its stores column by column then holds one store's splits at a time. ``held()`` / ``held_bytes()`` say what the session holds now (tests, ``make bench``).
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
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
    uses: Counter = field(default_factory=Counter)  # signature -> planned runs not yet done (``expect``)
    tags: dict = field(
        default_factory=dict
    )  # (kind, cache key) -> signatures of the runs that read the entry
    released: int = 0  # entries dropped after their last planned use
    planned: bool = (
        False  # an outer caller (``reproduce``) counted the runs: ``run_sweep`` does not count again
    )
    memos_emptied: int = 0  # stores whose memo of feature arrays was emptied after their last planned load
    loads: dict = field(
        default_factory=dict
    )  # store signature -> data signatures not loaded yet (its memo of feature arrays serves them)

    KINDS = ("stores", "partitions", "data", "live")

    def expect(self, cfgs) -> None:
        """Count the planned runs ``cfgs`` (each entry they read is kept until its last one is ``done``)."""
        for cfg in cfgs:
            sig = signatures(cfg)
            self.uses.update(set(sig.values()))
            self.loads.setdefault(sig["stores"], set()).add(sig["data"])

    def done(self, cfgs) -> int:
        """Runs ``cfgs`` are finished (or failed): count their uses down and drop every entry no planned run
        reads any more. Returns how many entries were dropped."""
        ended = set()
        for cfg in cfgs:
            for sig in set(signatures(cfg).values()):
                if self.uses.get(sig, 0) > 0:
                    self.uses[sig] -= 1
                    if self.uses[sig] == 0:
                        del self.uses[sig]
                        ended.add(sig)
        for sig in ended:  # a finished cell loads nothing more
            if sig[0] == "data":
                self._loaded(sig)
        if not ended:
            return 0
        drop = [
            tk
            for tk, sigs in self.tags.items()
            if sigs & ended and all(self.uses.get(g, 0) == 0 for g in sigs)
        ]
        freed, seen = 0, set()
        for kind, key in drop:
            entry = getattr(self, kind).pop(key, None)
            freed += nbytes(entry, seen) if kind == "data" else 0
            del self.tags[(kind, key)]
        self.released += len(drop)
        if drop and freed >= GC_MIN_BYTES:  # RunData <-> memo / context closures: free the tensors now
            gc.collect()
        return len(drop)

    def loaded(self, cfg: RunConfig) -> None:
        """The run ``cfg``'s features were loaded from its store (``run_data``)."""
        self._loaded(signatures(cfg)["data"])

    def _loaded(self, data_sig: tuple) -> None:
        """``data_sig`` will not read its store again: once no planned cell of that store is left to load, the
        store's memo of whole feature arrays (``FeatureStore.features``: the verified float16 splits, which spare
        each cell of the store a read and a checksum pass) is emptied. The open store itself is kept to its last
        run. Without this, a grid that goes from store to store (``reproduce``: column by column) held every
        store's splits to its end."""
        where = data_sig[1]  # ("data", store location, ...): ``signatures``
        pend = self.loads.get(("store", where))
        if pend is None:
            return
        pend.discard(data_sig)
        if not pend:
            del self.loads[("store", where)]
            store = self.stores.get(where)
            memo = getattr(store, "memo", None)
            if memo:
                memo.clear()
                self.memos_emptied += 1

    def _tag(self, kind: str, key, cfg: RunConfig) -> None:
        self.tags.setdefault((kind, key), set()).add(signatures(cfg)[kind])

    def held(self) -> dict[str, int]:
        """How many entries of each kind the session holds now."""
        return {k: len(getattr(self, k)) for k in self.KINDS}

    def held_bytes(self) -> int:
        """Bytes of the tensors / arrays the session holds: its RunData (with their memos) and its stores'
        memos of verified features (each storage counted once)."""
        seen: set = set()
        data = sum(nbytes(d, seen) for d in self.data.values())
        return data + sum(nbytes(getattr(s, "memo", None) or {}, seen) for s in self.stores.values())


# a drop that frees less than this is left to Python's own collections: a full gc.collect() costs ~0.1 s with torch
# and numba loaded (measured: 22 of them were 3.1 of a 5.0 s sweep of 70 tiny runs), and what it would free early
# is then a few MB
GC_MIN_BYTES = 32 << 20


def nbytes(x, seen: set | None = None) -> int:
    """Bytes of the tensors and arrays in ``x`` (a RunData, a memo, lists / dicts / dataclasses of them; a store or
    live encoder inside is not counted), each storage once across calls sharing ``seen``."""
    import numpy as np
    import torch

    seen = set() if seen is None else seen
    if isinstance(x, torch.Tensor):
        k = ("t", x.untyped_storage().data_ptr(), x.device.type)
        if k in seen:
            return 0
        seen.add(k)
        return x.untyped_storage().nbytes()
    if isinstance(x, np.ndarray):
        base = x if x.base is None else x.base
        if not isinstance(base, np.ndarray) or id(base) in seen:
            return 0
        seen.add(id(base))
        return base.nbytes
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v, seen) for v in x)
    if isinstance(x, dict):
        return sum(nbytes(v, seen) for v in x.values())
    if hasattr(x, "__dataclass_fields__"):
        return sum(nbytes(getattr(x, f), seen) for f in x.__dataclass_fields__ if f not in ("store", "live"))
    return 0


def signatures(cfg: RunConfig) -> dict[str, tuple]:
    """Each cached item's signature for a run: computed from its config alone, before any store is opened; two
    runs that can share an entry have the same signature (``Session`` docstring). Derived from the run
    specification: every setting declared to key a cache (``fedfeat.spec.cache_key``) is in its signature."""
    from fedfeat.spec import cache_key
    from fedfeat.store.urls import canonical_store

    where = canonical_store(cfg.store)
    return {
        "stores": cache_key(cfg, "store", where),
        "partitions": cache_key(cfg, "partition", where),
        "data": cache_key(cfg, "data", where),
        "live": cache_key(cfg, "live", where),
    }


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
        sess._tag("stores", where, cfg)
    else:
        store = FeatureStore.open(cfg.store, mode="r")
        check_labels(store)
        if sess is not None:
            store.memo = {}  # verified feature arrays kept for the session's other runs
            sess.stores[where] = store
            sess._tag("stores", where, cfg)
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
            f"{cfg.store_fingerprint}; pass --store to run it on this store anyway (without --store-fingerprint), or "
            "point it at the original"
        )
    cfg.store = where  # config.toml works from any working directory
    cfg.store_fingerprint = have
    return store


def run_partition(store, cfg: RunConfig, save: bool):
    """``(key, Partition, stored)``: computed in memory (the store is opened read-only); saved into the store
    only when asked (``--save-partition``) and the store is writable. A partition file (``--partition FILE.json``,
    ``fedfeat.partition.external``) is read and checked against the store instead; the run's ``partition`` becomes
    the file's absolute path and its ``clients`` the file's client count (``--clients`` left at its default: the
    file sets it), so that ``config.toml`` replays it from anywhere."""
    from fedfeat.partition import external
    from fedfeat.partition import stored as stored_partition
    from fedfeat.partition.openvocab import class_order_mode, preset_class_order

    sess = active()
    order = None  # disjoint-classes drawn in the preset's class order (--class-order preset)
    if cfg.partition == "disjoint-classes" and class_order_mode(cfg.class_order, cfg.preset) == "preset":
        order = preset_class_order(cfg.preset, store.class_names)
    ck = signatures(cfg)["partitions"]
    if sess is not None and ck in sess.partitions:
        key, part = sess.partitions[ck]
        sess._tag("partitions", ck, cfg)
    elif external.is_partition_file(cfg.partition):
        from fedfeat.runs.config import DEFAULTS

        key, part = external.load(
            store, cfg.partition, clients=cfg.clients, clients_given=cfg.clients != DEFAULTS["clients"]
        )
        if sess is not None:
            sess.partitions[ck] = (key, part)
            sess._tag("partitions", ck, cfg)
    else:
        from fedfeat.spec import partition_args

        key, part = stored_partition.store_partition(
            store,
            **partition_args(cfg),
            save=False,
            class_order=order,
            class_order_name=None if order is None else cfg.preset,
        )
        if sess is not None:
            sess.partitions[ck] = (key, part)
            sess._tag("partitions", ck, cfg)
    if external.is_partition_file(cfg.partition):  # its path and client count, as config.toml replays them
        from pathlib import Path

        cfg.partition, cfg.clients = str(Path(cfg.partition).expanduser().absolute()), part.n_clients
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
    ck = (signatures(cfg)["data"], key, str(device), centralized)
    if sess is not None and ck in sess.data:
        sess._tag("data", ck, cfg)
        return sess.data[ck]
    data = load_run_data(
        store, part, device=device, centralized=centralized, local_val=lv, query_val=qv, local_test=lt,
        val_split=vs,
    )  # fmt: skip
    if sess is not None:
        sess.loaded(cfg)  # the store's memo of whole splits is emptied after its last planned load
        data.memo = {}
        sess.data[ck] = data
        sess._tag("data", ck, cfg)
    return data


def live_text(store, cfg: RunConfig, device):
    from fedfeat.encoders.live import load_live_text

    sess = active()
    ck = (signatures(cfg)["live"], str(device))
    if sess is not None and ck in sess.live:
        sess._tag("live", ck, cfg)
        return sess.live[ck]
    live = load_live_text(store, device=device, pretrained=cfg.pretrained)
    if sess is not None:
        sess.live[ck] = live
        sess._tag("live", ck, cfg)
    return live
