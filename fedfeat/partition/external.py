"""A partition made elsewhere: ``fedfeat train --partition FILE.json`` (and ``sweep``, ``fedfeat.train``).

**The file format** is what ``fedfeat partition STORE ... --export FILE.json`` writes, and any tool can write it::

    {"clients": [[3, 17, 52], [0, 8], ...],   # required: client i's rows of the store's train split (0-based)
     "scheme": "dirichlet",                   # optional, informational: how it was made
     "params": {"alpha": 0.1, ...},           # optional, informational; "split" (if given) must be "train";
                                              #   "test_clients" (dirichlet-joint): each client's rows of the
                                              #   test split's labelled rows, for --local-test joint
     "store_fingerprint": "0123456789abcdef"} # optional: the store it was made for (`fedfeat info` prints it)

A value of ``--partition`` ending in ``.json`` is such a file; anything else is a scheme name. JSON is data: reading
the file runs no code.

**Checked against the run's store**, each problem one line naming it and the fix: a JSON object with a ``clients``
list of lists; every index an integer (not a float, boolean or string) in ``0 .. N-1`` for the store's ``N`` train
rows, and not a row whose label is -1 (an image skipped at encode time); no row twice, in one client or in two; no
empty client (the engine trains clients that hold at least one row); as many clients as ``--clients``, or, when
``--clients`` is left at its default, the file sets it; the store's fingerprint, when the file carries one;
``test_clients`` under the same rules against the test split. The settings that shape a *drawn* partition
(``--partition-seed``, ``--imbalance-factor``, ``--preset``, a scheme's parameters such as ``--alpha``) are refused
with a file. A file partition is closed-vocabulary: every client's rows train, the whole test split evaluates.

**Identity.** A file partition is its content: the sha256 of the file's bytes. The run's settings hash, the session's
cache keys, the stack groups, the checkpoint identity and the seed-table groups see ``file:sha256:<hex>``
(``identity``), never the path; its key (``file-<12 hex>-c<clients>``) names the run and ``summary.json``'s
``partition``. So two different files never share a run name or a cache entry, and the same bytes at two paths do.
The run keeps the partition it used in its directory (``partition.json``, as for any partition it computed), and
``config.toml`` records the file's absolute path (a replay reads the file again: if its bytes changed, the replay
is another run, under another name)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.core import Partition

SUFFIX = ".json"
SCHEME = "file"  # the scheme name a file partition is recorded under (its key: ``file-<hex>-c<clients>``)
_FIX = "pass a file in the format `fedfeat partition STORE --export FILE.json` writes"

_DIGESTS: dict[
    str, tuple[tuple, str]
] = {}  # absolute path -> (stat signature, sha256 hex): hashed once per change


def is_partition_file(value) -> bool:
    """Whether a ``--partition`` value names a partition file (it ends in ``.json``) rather than a scheme."""
    return isinstance(value, str) and value.lower().endswith(SUFFIX)


def _problem(path: Path) -> tuple[str | None, os.stat_result | None]:
    """What is wrong with ``path`` as a partition file, after ``--partition`` (None: nothing), and its stat."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return (
            f"{path}: no such partition file; pass the path of one (`fedfeat partition STORE --export "
            f"{path.name}` writes one) or a scheme name",
            None,
        )
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror or e}); check its permissions", None
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a directory, FIFO or device); {_FIX}", None
    return None, st


def _stat(path: Path) -> os.stat_result:
    why, st = _problem(path)
    if why is not None:
        raise FedfeatError(f"--partition {why}")
    return st


def _signature(st: os.stat_result) -> tuple:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def digest(path) -> str:
    """sha256 (hex) of the file's bytes; read again only when its size, mtime or inode changed."""
    p = Path(path).expanduser().absolute()
    sig = _signature(_stat(p))
    hit = _DIGESTS.get(str(p))
    if hit is not None and hit[0] == sig:
        return hit[1]
    return _read(p)[1]


def _read(p: Path) -> tuple[bytes, str]:
    """The file's bytes and their sha256, remembered for ``digest``."""
    sig = _signature(_stat(p))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FedfeatError(
            f"--partition {p}: cannot read it ({e.strerror or e}); check its permissions"
        ) from None
    hexd = hashlib.sha256(data).hexdigest()
    _DIGESTS[str(p)] = (sig, hexd)
    return data, hexd


def identity(value):
    """What a ``--partition`` value stands for in names, hashes and cache keys: a scheme name as it is, a file as
    ``file:sha256:<hex>`` of its content (module docstring)."""
    if not is_partition_file(value):
        return value
    return f"file:sha256:{digest(value)}"


def check_setting(value: str, spec) -> str | None:
    """``--partition FILE.json``'s complaint (after the flag), or None: the file is there, and no setting of a
    drawn partition is given beside it. ``spec``: the run's ``RunSpec``."""
    why, _ = _problem(Path(value).expanduser())
    if why is not None:
        return why
    given = [flag for flag, v in (("--partition-seed", spec.partition.seed),
                                  ("--imbalance-factor", spec.partition.imbalance_factor),
                                  ("--preset", spec.data.preset)) if v is not None]  # fmt: skip
    if given:
        return (
            f"{value} is a partition made already: {given[0]} shapes a drawn partition; drop {given[0]}, or draw "
            "one with a scheme name instead of the file"
        )
    return None


def key(sha256: str, clients: int) -> str:
    """The key a file partition names its runs with: ``file-<12 hex>-c<clients>``."""
    return f"{SCHEME}-{sha256[:12]}-c{int(clients)}"


def _rows(client, what: str, where: str) -> np.ndarray:
    """One client's list of row indices as int64, or one line naming the first entry that is not an integer."""
    if not isinstance(client, list):
        raise FedfeatError(
            f"{where}: {what} is {type(client).__name__} {client!r:.40}, not a list of row indices; {_FIX}"
        )
    bad = [x for x in client if type(x) is not int][:1]  # a float, bool, string, null or list is no row index
    if bad:
        raise FedfeatError(
            f"{where}: {what} holds {json.dumps(bad[0])[:40]}, not an integer row index; {_FIX}"
        )
    try:
        return np.asarray(client, dtype=np.int64)
    except OverflowError:
        big = max(client, key=abs)
        raise FedfeatError(f"{where}: {what} holds {big}, not a row index of any store; {_FIX}") from None


def _check_clients(clients: list[np.ndarray], n: int, labels: np.ndarray | None, split: str, where: str,
                   name: str = "client", allow_empty: bool = False) -> None:  # fmt: skip
    """Rows in range of the split's ``n`` rows, labelled (``labels``: -1 = skipped at encode time), each in one
    client once, no client empty (unless ``allow_empty``: local test splits): the first problem, one line."""
    for i, c in enumerate(clients):
        if not len(c) and allow_empty:
            continue
        if not len(c):
            empty = sum(1 for x in clients if not len(x))
            raise FedfeatError(
                f"{where}: {name} {i} holds no rows ({empty} of {len(clients)} {name}s are empty); every client must "
                "hold at least one row: remove the empty ones (and the --clients count with them) or give them rows"
            )
        lo, hi = int(c.min()), int(c.max())
        if lo < 0 or hi >= n:
            r = lo if lo < 0 else hi
            raise FedfeatError(
                f"{where}: {name} {i} holds row {r}, but the store's {split} split has {n} rows (0..{n - 1}); is the "
                "file for another store?"
            )
        if labels is not None and (labels[c] < 0).any():
            r = int(c[labels[c] < 0][0])
            raise FedfeatError(
                f"{where}: {name} {i} holds row {r}, an image skipped at encode time (label -1); remove it"
            )
    order = np.concatenate(clients) if clients else np.zeros(0, np.int64)
    if len(np.unique(order)) == len(order):
        return
    owner = np.repeat(np.arange(len(clients)), [len(c) for c in clients])
    srt = np.argsort(order, kind="stable")
    dup = srt[1:][order[srt[1:]] == order[srt[:-1]]][0]  # the second holder of the first row held twice
    row = int(order[dup])
    holders = sorted(set(owner[order == row].tolist()))
    if len(holders) == 1:
        raise FedfeatError(
            f"{where}: {name} {holders[0]} holds row {row} twice; a row is held once: remove one"
        )
    raise FedfeatError(
        f"{where}: row {row} is in {name} {holders[0]} and {name} {holders[1]}; a row belongs to one client: remove "
        "it from all but one"
    )


def load(store, path, *, clients: int, clients_given: bool) -> tuple[str, Partition]:
    """The partition in file ``path`` for ``store``'s train split, checked (module docstring): ``(key, Partition)``.

    ``clients``: the run's ``--clients``; ``clients_given``: whether it was set (False: the file sets it)."""
    p = Path(path).expanduser().absolute()
    where = f"partition file {path}"
    data, sha = _read(p)
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise FedfeatError(f"{where} is not UTF-8 text (byte {e.start}); {_FIX}") from None
    except ValueError as e:  # json.JSONDecodeError, or a number JSON cannot hold
        raise FedfeatError(f"{where} is not valid JSON ({e}); {_FIX}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("clients"), list):
        what = "has no 'clients' list" if isinstance(doc, dict) else f"is a JSON {type(doc).__name__}"
        raise FedfeatError(f'{where} {what}; it must be an object {{"clients": [[row, ...], ...]}}: {_FIX}')
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise FedfeatError(f"{where}: params is {type(params).__name__}, not an object; {_FIX}")
    split = params.get("split", "train")
    if split != "train":
        raise FedfeatError(
            f"{where} partitions split {split!r}; train takes a partition of the train split (fedfeat partition "
            "--split train --export FILE.json)"
        )
    fp = doc.get("store_fingerprint")
    have = store.attrs.get("fingerprint_hash")
    if fp is not None and fp != have:
        raise FedfeatError(
            f"{where} was made for a store with fingerprint {fp}, but store {store.path} has {have}; pass the store "
            "it was made for, or a partition of this store"
        )
    parts = [_rows(c, f"client {i}", where) for i, c in enumerate(doc["clients"])]
    if not parts:
        raise FedfeatError(f"{where} has no clients; {_FIX}")
    if clients_given and len(parts) != clients:
        raise FedfeatError(
            f"{where} has {len(parts)} clients, but --clients is {clients}; drop --clients (the file sets it) or "
            f"pass --clients {len(parts)}"
        )
    labels = np.asarray(store.labels("train"))
    _check_clients(parts, len(labels), labels, "train", where)
    record = {"scheme": SCHEME, "clients": len(parts), "file": str(p), "sha256": sha,
              "source_scheme": doc.get("scheme"), "store_fingerprint": have}  # fmt: skip
    tc = params.get("test_clients")
    if (
        tc is not None
    ):  # dirichlet-joint: each client's rows of the test split's labelled rows (--local-test joint)
        if not isinstance(tc, list) or len(tc) != len(parts):
            n_tc = len(tc) if isinstance(tc, list) else type(tc).__name__
            raise FedfeatError(
                f"{where}: params.test_clients has {n_tc} entries for {len(parts)} clients; give one list per client "
                "or drop params.test_clients"
            )
        if "test" not in store.splits:
            raise FedfeatError(
                f"{where} has params.test_clients, but store {store.path} has no test split; drop them"
            )
        tl = np.asarray(store.labels("test"))
        test = [_rows(c, f"params.test_clients[{i}]", where) for i, c in enumerate(tc)]
        _check_clients(
            test, int((tl >= 0).sum()), None, "test (labelled rows)", where, "test client", allow_empty=True
        )
        record["test_clients"] = [t.tolist() for t in test]
    return key(sha, len(parts)), Partition(SCHEME, record, parts)


__all__ = ["SCHEME", "SUFFIX", "check_setting", "digest", "identity", "is_partition_file", "key", "load"]
