"""Paper tables: ``fedfeat reproduce NAME`` runs a paper's grid (datasets x partitions x methods x seeds) in one
process (``fedfeat.sweep``) and prints it in the paper's layout, ours (mean ± std over seeds) beside the paper's.

Stores come from ``--store-root``: ``ROOT/<dataset>/<backbone>-*.zarr`` as ``fedfeat encode`` (and the
``make cache-...`` targets) write them; a missing one is named with the target that builds it. ``--synthetic``
builds stand-in stores instead (``fedfeat synth``, shaped like each dataset under the paper's backbone), so that
the grid runs anywhere -- and its numbers then say nothing about real data.

Tables (the paper's numbers are transcribed from ``../shared/papers``; the settings are the papers' and
``reference-notes.md``'s):

* ``fst-cbdg-table1`` -- FST-CBDG Table 1: IID, 100 clients, 10 % per round, 10 rounds, RN50; CLIP-ZS,
  CLIP-FC-Centralized, FedAvg, FedNTD, FST-CBDG on CIFAR-10 / CIFAR-100 / CINIC-10.
* ``fst-cbdg-table2`` -- Table 2: sharding (s = 2, 3, 5, 10 on CIFAR-10; 10 on CIFAR-100; 2 on CINIC-10) and
  LDA (alpha = 0.05, 0.1, 0.3, 0.5 on CIFAR-10; 0.1 on CIFAR-100 and CINIC-10); FedAvg, FedNTD, FST-CBDG, with
  CLIP-ZS and centralized once per dataset (they do not depend on the partition).
* ``fst-cbdg-table3`` -- Table 3, ablations (self-training only, sampling only, sampling centralized, both) on
  CIFAR-10 (s = 2, IID) and CIFAR-100 (s = 10, IID).
* ``fst-cbdg-table4`` -- Table 4, equal vs class-balanced sampling on CIFAR-10 and CIFAR-100 (s = 10, IID).
* ``clip2fl-table1`` -- CLIP2FL Table 1 (ours: the methods fedfeat has): FedAvg, FedAvgM, FedProx, CReFF, CLIP2FL on
  CIFAR-10-LT / CIFAR-100-LT at IF = 100, 50, 10; 20 clients, 40 % per round, Dirichlet-equal alpha = 0.5,
  ViT-B/32; the paper's 200 rounds (``--rounds`` for fewer: CReFF's server costs ~1 s a round on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError


@dataclass(frozen=True)
class Column:
    dataset: str
    label: str
    settings: dict  # partition settings of this column


@dataclass(frozen=True)
class Row:
    label: str
    method: str
    params: dict = field(default_factory=dict)
    once_per_dataset: bool = (
        False  # partition-free (zero-shot, centralized): one run per dataset, shown per column
    )
    settings: dict = field(default_factory=dict)  # run settings of this row (e.g. centralized-by-one-client)


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    backbone: str  # the stores' backbone (file name prefix) and the synthetic stand-in's shape
    make_target: str
    columns: list[Column]
    rows: list[Row]
    paper: dict[str, list[float | None]]  # row label -> the paper's value per column
    fixed: dict  # run settings shared by every run


# synthetic stand-ins: (classes, train per class, test per class, dim)
SYNTH_SHAPES = {
    ("cifar10", "RN50"): dict(classes=10, train_per_class=5000, test_per_class=1000, dim=1024),
    ("cifar100", "RN50"): dict(classes=100, train_per_class=500, test_per_class=100, dim=1024, s=0.1),
    # CINIC-10 has 90,000 train and 90,000 test images; the stand-in keeps the train split and 10,000 test images
    ("cinic10", "RN50"): dict(classes=10, train_per_class=9000, test_per_class=1000, dim=1024),
    ("cifar10", "ViT-B-32"): dict(classes=10, train_per_class=5000, test_per_class=1000, dim=512),
    ("cifar100", "ViT-B-32"): dict(classes=100, train_per_class=500, test_per_class=100, dim=512, s=0.1),
}

FST = {"clients": 100, "participation": 0.1, "rounds": 10}
_ZS = Row("CLIP-ZS", "zeroshot", once_per_dataset=True)
_CENT = Row("CLIP-FC-Centralized", "centralized", once_per_dataset=True)
_FST_ROWS = [Row("FedAvg", "fedavg"), Row("FedNTD", "fedntd"), Row("FST-CBDG", "fst-cbdg")]


def _shard(ds: str, s: int) -> Column:
    return Column(ds, f"{ds} s={s}", {"partition": "shard", "shards": s})


def _lda(ds: str, a: float) -> Column:
    return Column(ds, f"{ds} a={a}", {"partition": "dirichlet", "alpha": a})


def _iid(ds: str) -> Column:
    return Column(ds, f"{ds} iid", {"partition": "iid"})


def _lt(ds: str, f: int) -> Column:
    return Column(
        ds, f"{ds}-LT IF={f}", {"partition": "dirichlet-equal", "alpha": 0.5, "imbalance_factor": f}
    )


TABLES: dict[str, Table] = {
    "fst-cbdg-table1": Table(
        "fst-cbdg-table1",
        "FST-CBDG Table 1: test accuracy (%), homogeneous (IID) partition",
        "RN50",
        "make cache-fst-cbdg",
        [_iid("cifar10"), _iid("cifar100"), _iid("cinic10")],
        [_ZS, _CENT, *_FST_ROWS],
        {
            "CLIP-ZS": [68.7, 39.0, 63.2],
            "CLIP-FC-Centralized": [77.5, 42.9, 70.4],
            "FedAvg": [73.3, 37.8, 66.0],
            "FedNTD": [72.8, 39.8, 66.2],
            "FST-CBDG": [74.0, 43.2, 66.3],
        },
        FST,
    ),  # fmt: skip
    "fst-cbdg-table2": Table(
        "fst-cbdg-table2",
        "FST-CBDG Table 2: test accuracy (%), heterogeneous partitions (sharding s, LDA alpha)",
        "RN50",
        "make cache-fst-cbdg",
        [
            _shard("cifar10", 2),
            _shard("cifar10", 3),
            _shard("cifar10", 5),
            _shard("cifar10", 10),
            _shard("cifar100", 10),
            _shard("cinic10", 2),
            _lda("cifar10", 0.05),
            _lda("cifar10", 0.1),
            _lda("cifar10", 0.3),
            _lda("cifar10", 0.5),
            _lda("cifar100", 0.1),
            _lda("cinic10", 0.1),
        ],
        [_ZS, _CENT, *_FST_ROWS],
        {
            "CLIP-ZS": [68.7] * 4 + [39.0, 63.2] + [68.7] * 4 + [39.0, 63.2],
            "CLIP-FC-Centralized": [77.5] * 4 + [42.9, 70.4] + [77.5] * 4 + [42.9, 70.4],
            "FedAvg": [32.3, 42.0, 43.5, 47.7, 34.1, 30.9, 20.1, 32.4, 41.9, 45.1, 16.4, 29.1],
            "FedNTD": [42.0, 64.1, 47.6, 55.6, 26.6, 35.8, 26.6, 28.2, 37.1, 52.9, 15.9, 26.6],
            "FST-CBDG": [72.0, 72.8, 73.6, 73.2, 43.3, 65.9, 71.5, 71.9, 72.2, 72.4, 43.1, 65.0],
        },
        FST,
    ),  # fmt: skip
    "fst-cbdg-table3": Table(
        "fst-cbdg-table3",
        "FST-CBDG Table 3: ablation of the two losses, test accuracy (%)",
        "RN50",
        "make cache-fst-cbdg",
        [_shard("cifar10", 2), _iid("cifar10"), _shard("cifar100", 10), _iid("cifar100")],
        [
            _ZS,
            Row("L_iST", "fst-cbdg", {"sampling": "false"}),
            Row("L_tSamp", "fst-cbdg", {"self_training": "false"}),
            Row(
                "L_tSamp (Centralized)",
                "fst-cbdg",
                {"self_training": "false"},
                once_per_dataset=True,
                settings={"clients": 1, "participation": 1.0, "partition": "iid"},
            ),
            Row("L_iST + L_tSamp", "fst-cbdg"),
        ],
        {
            "CLIP-ZS": [68.7, 68.7, 39.0, 39.0],
            "L_iST": [68.9, 68.2, 37.5, 37.5],
            "L_tSamp": [68.9, 65.7, 37.3, 35.5],
            "L_tSamp (Centralized)": [69.4, 69.4, 39.1, 39.1],
            "L_iST + L_tSamp": [72.0, 74.0, 43.3, 43.2],
        },
        FST,
    ),  # fmt: skip
    "fst-cbdg-table4": Table(
        "fst-cbdg-table4",
        "FST-CBDG Table 4: sampling strategy, test accuracy (%)",
        "RN50",
        "make cache-fst-cbdg",
        [_shard("cifar10", 10), _iid("cifar10"), _shard("cifar100", 10), _iid("cifar100")],
        [Row("Equal sampling", "fst-cbdg", {"balance": "equal"}), Row("Balanced sampling", "fst-cbdg")],
        {"Equal sampling": [68.6, 68.6, 37.4, 37.4], "Balanced sampling": [73.2, 74.0, 43.3, 43.2]},
        FST,
    ),  # fmt: skip
    "clip2fl-table1": Table(
        "clip2fl-table1",
        "CLIP2FL Table 1: top-1 accuracy (%), long-tailed CIFAR (the rows fedfeat implements)",
        "ViT-B-32",
        "make cache-clip2fl",
        [
            _lt("cifar10", 100),
            _lt("cifar10", 50),
            _lt("cifar10", 10),
            _lt("cifar100", 100),
            _lt("cifar100", 50),
            _lt("cifar100", 10),
        ],
        [
            Row(
                "FedAvg",
                "fedavg",
                {"local_epochs": "10", "batch_size": "32", "lr": "0.1", "momentum": "0", "weight_decay": "0"},
            ),
            Row("FedAvgM", "fedavgm"),
            Row("FedProx", "fedprox"),
            Row("CReFF", "creff"),
            Row("CLIP2FL", "clip2fl"),
        ],
        {
            "FedAvg": [56.17, 59.36, 77.45, 30.34, 36.35, 45.87],
            "FedAvgM": [52.03, 57.11, 70.81, 30.80, 35.33, 44.66],
            "FedProx": [56.92, 60.89, 76.53, 31.67, 36.30, 46.10],
            "CReFF": [70.55, 73.08, 80.71, 34.67, 37.64, 47.08],
            "CLIP2FL": [73.37, 75.35, 81.18, 37.56, 41.29, 48.20],
        },
        {"clients": 20, "participation": 0.4, "rounds": 200},
    ),  # fmt: skip
}


def find_store(root: Path, dataset: str, backbone: str, table: Table, synthetic: bool, log) -> Path:
    """The store of ``dataset`` under ``root``: a stand-in built on first use (``synthetic``), else the encoded
    one; a missing store is a one-line error naming the make target that builds it."""
    if synthetic:
        from fedfeat.store import is_store
        from fedfeat.synth import SynthParams, write_synthetic_store

        path = root / f"synth-{dataset}-{backbone.lower()}.zarr"
        if not is_store(path):
            log(f"building the synthetic stand-in {path} (its numbers say nothing about real {dataset})")
            write_synthetic_store(path, SynthParams(**SYNTH_SHAPES[(dataset, backbone)]), stats=False,
                                  log=lambda *a: None)  # fmt: skip
        return path
    found = sorted((root / dataset).glob(f"{backbone}*.zarr")) if (root / dataset).is_dir() else []
    if not found:
        raise FedfeatError(
            f"no {backbone} store of {dataset} under {root}/{dataset}/; build it with `{table.make_target}` "
            f"(datasets under DATA=~/data), pass --store-root, or run with --synthetic"
        )
    return found[0]


def drawable(table: Table, stores: dict[str, Path]) -> dict[int, str]:
    """Columns whose partition cannot be drawn on their store, with the partitioner's reason (FedNTD's Dirichlet
    rule never gives 100 clients >= 10 samples each at alpha = 0.05 on 10 classes: its code loops forever)."""
    from fedfeat.runs import open_store, resolve_config, run_partition

    bad = {}
    for c, col in enumerate(table.columns):
        cfg = resolve_config({**table.fixed, **col.settings, "store": str(stores[col.dataset])}, None, None)
        try:  # inside the sweep's session: the partition is computed once, here, and reused by its runs
            run_partition(open_store(cfg), cfg, False)
        except FedfeatError as e:
            bad[c] = str(e)
    return bad


def points(
    table: Table, stores: dict[str, Path], seeds: list[int], out: Path, rounds: int | None, skip=()
) -> tuple[list, dict]:
    """The sweep points of ``table`` and, per (row, column), the indices of its points (one per seed); columns in
    ``skip`` get none."""
    pts, where = [], {}
    fixed = dict(table.fixed)
    if rounds is not None:
        fixed["rounds"] = rounds
    fixed["eval_every"] = fixed[
        "rounds"
    ]  # the tables report final accuracy: evaluate at rounds 0 and last only
    for r, row in enumerate(table.rows):
        done_ds: dict[str, list[int]] = {}
        for c, col in enumerate(table.columns):
            if c in skip and not row.once_per_dataset:
                where[(r, c)] = []
                continue
            if row.once_per_dataset and col.dataset in done_ds:
                where[(r, c)] = done_ds[col.dataset]
                continue
            idx = []
            for s in seeds:
                settings = {**fixed, **col.settings, **row.settings, "method": row.method, "seed": s,
                            "store": str(stores[col.dataset]), "out": str(out)}  # fmt: skip
                if row.once_per_dataset and "partition" not in row.settings:
                    settings.update({"partition": "iid", "alpha": None, "shards": None})
                    settings.pop("imbalance_factor", None)
                settings = {k: v for k, v in settings.items() if v is not None}
                idx.append(len(pts))
                pts.append((settings, dict(row.params)))
            where[(r, c)] = idx
            if row.once_per_dataset:
                done_ds[col.dataset] = idx
    return pts, where


def render(
    table: Table, summaries: list[dict], where: dict, synthetic: bool, fmt: str = "markdown", skipped=None
) -> str:
    """The paper's layout: rows = methods, columns = settings; a cell = ours mean ± std (n) and the paper's."""
    import json

    from fedfeat.runs import _table

    skipped = skipped or {}
    cells = {}
    for (r, c), idx in where.items():
        v = np.array([summaries[i]["final_acc"] for i in idx], dtype=np.float64)
        cells[(r, c)] = (
            (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else None, len(v))
            if len(v)
            else (None, None, 0)
        )
    if fmt == "json":
        return json.dumps([
            {"row": row.label, "column": col.label, "mean": cells[(r, c)][0], "std": cells[(r, c)][1],
             "n": cells[(r, c)][2], "paper": table.paper.get(row.label, [None] * len(table.columns))[c]}
            for r, row in enumerate(table.rows) for c, col in enumerate(table.columns)
        ], indent=1)  # fmt: skip
    cols = ["method"] + [c.label for c in table.columns]
    rows = []
    for r, row in enumerate(table.rows):
        line = [row.label]
        for c in range(len(table.columns)):
            m, s, n = cells[(r, c)]
            p = table.paper.get(row.label, [None] * len(table.columns))[c]
            ours = "n/a" if m is None else f"{m:.2f} ± {s:.2f}" if s is not None else f"{m:.2f}"
            line.append(f"{ours} ({p})" if p is not None else ours)
        rows.append(line)
    n = max(x[2] for x in cells.values())
    head = f"{table.title}\nours: final accuracy, mean ± std over {n} seed(s); (paper's number) beside it"
    if synthetic:
        head += (
            "\nSYNTHETIC STAND-IN STORES (--synthetic): these numbers say nothing about real data; they show the "
            "grid runs"
        )
    notes = "".join(f"\nn/a in {table.columns[c].label}: {why}" for c, why in skipped.items())
    return head + "\n\n" + _table(cols, rows, fmt) + ("\n" + notes if notes else "")


def reproduce(
    name: str,
    *,
    store_root: str | Path = "cache",
    synthetic: bool = False,
    seeds: int = 5,
    rounds: int | None = None,
    out: str | Path | None = None,
    fmt: str = "markdown",
    overwrite: bool = False,
    log=print,
) -> str:
    """Run table ``name``'s grid (finished runs are reused) and return it rendered."""
    from fedfeat.runs import load_run
    from fedfeat.sweep import run_sweep

    if name not in TABLES:
        raise FedfeatError(f"unknown table '{name}'; known: {', '.join(TABLES)}")
    if seeds < 1:
        raise FedfeatError(f"--seeds must be >= 1, got {seeds}")
    if fmt not in ("markdown", "csv", "json"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
    table = TABLES[name]
    root = Path(store_root)
    stores = {
        c.dataset: find_store(root, c.dataset, table.backbone, table, synthetic, log) for c in table.columns
    }
    out = (
        Path(out)
        if out is not None
        else Path("runs") / ("reproduce-" + name + ("-synthetic" if synthetic else ""))
    )
    from fedfeat.sweep import session

    with session():  # the columns' partitions, checked here, are the ones the runs use
        skipped = drawable(table, stores)
        for c, why in skipped.items():
            log(f"{table.columns[c].label}: the partition cannot be drawn ({why}); the column is left empty")
        pts, where = points(table, stores, list(range(seeds)), out, rounds, skip=skipped)
        log(
            f"{name}: {len(pts)} runs ({len(table.rows)} rows x {len(table.columns)} columns x {seeds} seeds)"
        )
        paths = run_sweep(pts, overwrite=overwrite, progress=False, log=log)
    summaries = [load_run(p)[0] for p in paths]
    return render(table, summaries, where, synthetic, fmt, skipped)


__all__ = ["TABLES", "reproduce"]
