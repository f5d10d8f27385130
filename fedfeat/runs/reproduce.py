"""Paper tables: ``fedfeat reproduce NAME`` runs a paper's grid (datasets x partitions x methods x seeds) in one
process (``fedfeat.runs.sweep``) and prints it in the paper's layout, ours (mean ± std over seeds) beside the paper's.

(Over ~600 lines on purpose: the tables' layout -- rows, columns, the paper's numbers beside ours, stand-in labels, n/a
cells -- and their grids are one job; the tables themselves are data, ``tables/*.toml``.)

Stores come from ``--store-root``: ``ROOT/<dataset>/<backbone>-*.zarr`` as ``fedfeat encode`` (and the
``make cache-...`` targets) write them; a missing one is named with the target that builds it. ``--synthetic``
builds stand-in stores instead (``fedfeat synth``, shaped like each dataset under the paper's backbone), so that
the grid runs anywhere -- and its numbers then say nothing about real data.

The tables are data: ``fedfeat/runs/tables/<paper>.toml``, one TOML file per paper (its tables' columns, rows,
the paper's numbers and run settings, its synthetic stand-ins' shapes), read by ``load_tables`` into ``TABLES``.

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
* ``clip2fl-table1`` -- CLIP2FL Table 1, all 12 rows: FedAvg, FedAvgM, FedProx, FedDF, FedBE, CCVR, FedNova,
  Fed-Focal Loss, Ratio Loss, FedAvg + tau-norm, CReFF, CLIP2FL on CIFAR-10-LT / CIFAR-100-LT at IF = 100, 50, 10; 20 clients, 40 % per round, Dirichlet-equal alpha = 0.5,
  ViT-B/32; the paper's 200 rounds (``--rounds`` for fewer: CReFF's server costs ~1 s a round on a CPU).
* ``fed-mp-table1`` -- Fed-MP Table 1, novel-class accuracy (open vocabulary: ``fedfeat.partition.openvocab``'s presets,
  disjoint classes, 10 clients x 10 shots, all clients, 2 rounds, ViT-L/14@336), in the paper's layout (datasets
  as rows, methods as columns, an Average row); ``fed-mp-table1-f1`` the same runs' novel macro-F1 (the table's
  Phi_F1 rows). FedAvg (NN) / FedKA (NN) fine-tune a ResNet-18 end to end: not fedfeat methods, shown n/a beside
  the paper's numbers; CLIP zero-shot is added (not in the paper).
* ``fedcopl-table1`` -- FedCoPL's main table (Dirichlet beta = 0.1 label shift, ViT-B/32): mean local test
  accuracy (``local_acc``, ``--partition dirichlet-joint --local-test joint``), 20 rounds, all clients, 10
  clients (5 for CUB and UCF101, reference-notes), DTD / RESISC45 / CUB / UCF101 / CIFAR-10 / CIFAR-100 and Avg.
  every row of the paper (pFedPrompt + CPL, FedOPT + CPL included); PromptFL + CPL and CoPL + linear head (fedfeat's
  cached-feature path) are added (not in the paper).

A table reports its ``metric`` (a key of the runs' ``summary.json``: ``final_acc``, ``local_acc``,
``novel_f1`` ...), named in its header. A store that is there but unusable (an empty folder, damaged or
unfinished, synthetic, of another backbone, class count or D) is a one-line error naming it, and so is a table in
which no cell has a number for a reason other than the two documented ones (a row fedfeat does not have, a
partition that cannot be drawn): never a table of n/a with status 0. ``--store-root`` may be a store URL (the
stores are read there; ``--synthetic`` builds its stand-ins in a local folder). A cell that cannot run is ``n/a``
with the reason printed under the table, never a crash: a partition the partitioner cannot draw (``drawable``); a row fedfeat does not have; a prompt
method (``needs_live_text``: ``promptfl``, ``fedtpg``, ``fedcopl``, ``pfedprompt``, ``fedopt``) on a store without a
live encoder or whose encoder cannot be rebuilt here (weights not cached); ``fedcopl`` / ``fedopt`` on a store
without pixels (``encode --pixels``); a run its method refuses.

Under ``--synthetic`` every row runs: the rows on cached features on feature stand-ins shaped like the paper's
backbone (``fedfeat synth``), the prompt rows on *live stand-ins* (``fedfeat.runs.standin``: synthetic images
encoded with pixels by a tiny random CLIP, whose encoder the prompt methods rebuild), as the header says.

Each row runs the reading of its authors' code, stated in the TOML (``docs/paper-code.md`` lists the paper/code
disagreements); each table's header states its setting (``setting``), and a ``--synthetic`` table's title says it
is a stand-in, not a reproduction. A table whose rows are not the paper's model (``clip2fl-table1``: ResNet-8s in
the paper, linear heads on frozen features here) says so in its TOML's ``reading``, printed in every format.
``fedfeat reproduce --list`` lists the tables (``list_tables``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomllib  # Python >= 3.11, as CI runs (tomli is not installed)

from fedfeat.errors import FedfeatError


@dataclass(frozen=True)
class Column:
    dataset: str
    label: str
    settings: dict  # partition settings of this column
    # the summary.json key this column reports ("" : the table's ``metric``): CLIP2FL Table 2's All / Many / Medium /
    # Few columns are one set of runs read four ways; columns of the same dataset and settings share their runs
    metric: str = ""
    # a domain (a dataset of a combined store): the column reports the per-domain metric's value of it
    # (``domain_base_acc`` of "dtd": ``derived_metric``'s ``domain_base_acc:dtd``)
    domain: str = ""


@dataclass(frozen=True)
class Row:
    label: str
    method: str | None  # None: a method of the paper's that fedfeat does not have (``why`` says so)
    params: dict = field(default_factory=dict)
    once_per_dataset: bool = (
        False  # partition-free (zero-shot, centralized): one run per dataset, shown per column
    )
    settings: dict = field(default_factory=dict)  # run settings of this row (e.g. centralized-by-one-client)
    why: str = ""  # method None: why the row is n/a
    per_dataset: Callable[[str], dict] | None = None  # dataset -> extra params (CPL's per-dataset quantiles)


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    backbone: str  # the stores' backbone (file name prefix) and the synthetic stand-in's shape
    make_target: str  # how a missing store is built: a make target, or a command with {dataset} / {root}
    columns: list[Column]
    rows: list[Row]
    paper: dict[str, list[float | None]]  # row label -> the paper's value per column, as the paper prints it
    fixed: dict  # run settings shared by every run
    metric: str = "final_acc"  # the summary.json key the table reports
    metric_label: str = "final accuracy (%)"
    paper_scale: float = 1.0  # paper's number x this = ours' unit (Fed-MP prints fractions: 100)
    paper_std: dict[str, list[float | None]] | None = None  # the paper's ± per cell, where it prints one
    paper_avg: dict[str, float | None] | None = None  # an "Avg." over the columns: the paper's per row
    transpose: bool = False  # the paper's layout has datasets as rows, methods as columns
    paper_format: str = ""  # format spec of the paper's numbers as shown ("" : as transcribed, 74.0)
    runs: str | None = None  # the runs' folder name (tables over the same runs share it); default: name
    # what ours' rows are where they are not the paper's model (CLIP2FL's ResNet-8 rows read as linear heads on frozen
    # features): printed in every format (markdown / CSV header, JSON ``reading`` of every cell and table)
    reading: str = ""
    notes: tuple = ()  # lines printed under the header (a paper's value beside the code's that the table runs)


def _cpl_params(dataset: str) -> dict:
    """CPL's per-dataset quantiles (``fedfeat.methods.pseudolabel.CPL_DEFAULTS``; CPL_GENERAL for CIFAR and UCF101)."""
    from fedfeat.methods.pseudolabel import cpl_preset

    q, t = cpl_preset(dataset)
    return {"conf_quantile": str(q), "regular_threshold": str(t)}


def _fedmp_params(dataset: str) -> dict:
    """Fed-MP's per-dataset epsilon (Appendix A; ``fedfeat.partition.openvocab.fedmp_preset_params``)."""
    from fedfeat.partition.openvocab import fedmp_preset_params

    return fedmp_preset_params(dataset)


TABLES_DIR = Path(__file__).with_name("tables")  # one TOML file per paper
_PER_DATASET = {
    "cpl": _cpl_params,
    "fedmp": _fedmp_params,
}  # the names a table row's ``per_dataset`` may give


# how ours is printed, by metric (default: ".2f", accuracies in %): seconds per image are ~1e-5 on cached features,
# trainable-parameter shares below 0.01 %
OURS_FORMAT = {"seconds_per_image": ".3g", "trainable_share": ".4f", "megabytes": ".3g", "train_seconds": ".3g"}


@functools.lru_cache(maxsize=64)
def _frozen_params(store: str | None, backbone: str) -> int | None:
    """The frozen CLIP's parameter count for a run on ``store``: its encoder's (``fedfeat.encoders.live``), or for a
    feature stand-in (``fedfeat synth``: no encoder) the table's ``backbone``'s, which the stand-in is shaped like."""
    from fedfeat.encoders.live import backbone_params, encoder_params

    if store is not None:
        from fedfeat.store.featurestore import FeatureStore

        try:
            st = FeatureStore.open(store)
        except FedfeatError:
            st = None
        if st is not None and st.attrs.get("backbone") not in (None, "synthetic"):
            return encoder_params(st)
    return backbone_params(backbone)


def derived_metric(table: Table, key: str, summary: dict):
    """A cell's value from a run's summary: the key itself, or a figure derived from it --
    ``KEY:NAME`` (domain NAME's value of a per-domain figure, e.g. ``domain_acc:sketch``), ``domain_acc_mean`` (their unweighted mean), ``trainable_share``: ``100 x trainable_params / (trainable_params + frozen CLIP's parameters)`` (Fed-MP Table 3's
    "ratio of trainable parameters"; ``_frozen_params``). None where the run records none."""
    if ":" in key:  # one domain's figure (summary.json domain_acc / domain_base_acc / ...: {domain: value})
        name, dom = key.split(":", 1)
        per = summary.get(name)
        return per.get(dom) if isinstance(per, dict) else None
    if key == "megabytes":  # what the run communicated, both ways (the cross-family table)
        up, down = summary.get("bytes_up"), summary.get("bytes_down")
        return None if up is None else (up + (down or 0)) / 2**20
    if key == "domain_acc_mean":  # the unweighted mean over the domains (FedCLIP's / FedOTP's "Avg")
        vals = [v for v in (summary.get("domain_acc") or {}).values() if v is not None]
        return float(np.mean(vals)) if vals else None
    if key != "trainable_share":
        return summary.get(key)
    n = summary.get("trainable_params")
    if n is None:
        return None
    total = _frozen_params(summary.get("store"), table.backbone)
    return None if total is None else 100.0 * n / (n + total)


def metric_of(table: Table, c: int) -> str:
    """The summary.json key column ``c`` reports: its own ``metric``, else the table's; ``KEY:DOMAIN`` for a domain
    column (a per-domain figure, ``derived_metric``)."""
    col = table.columns[c]
    key = col.metric or table.metric
    return f"{key}:{col.domain}" if col.domain else key


def _metrics_text(table: Table) -> str:
    """The metric(s) of the table's columns: ``final_acc``, or ``All: final_acc, Many: many_acc, ...`` where the
    columns report different keys."""
    keys = [metric_of(table, c) for c in range(len(table.columns))]
    if len(set(keys)) == 1:
        return keys[0]
    bare = {c.metric or table.metric for c in table.columns}
    if len(bare) == 1 and all(c.domain for c in table.columns):  # one per-domain figure, a column per domain
        return f"{bare.pop()} of each column's dataset ({', '.join(c.domain for c in table.columns)})"
    return ", ".join(f"{col.label}: {k}" for col, k in zip(table.columns, keys))


def _row(spec: dict) -> Row:
    spec = dict(spec)
    if "per_dataset" in spec:
        hook = spec["per_dataset"]
        if hook not in _PER_DATASET:
            raise ValueError(f"per_dataset '{hook}' is not known; known: {', '.join(_PER_DATASET)}")
        spec["per_dataset"] = _PER_DATASET[hook]
    return Row(**{"method": None, **spec})  # no method: a method of the paper's that fedfeat does not have


def load_tables(folder: Path = TABLES_DIR) -> tuple[dict[str, Table], dict, dict]:
    """The paper tables of ``folder/*.toml`` (in their files' ``order``), the synthetic stand-ins' shapes by
    ``(dataset, backbone)`` and the datasets' ``(format, folder)`` for ``fedfeat encode`` hints.

    A file holds ``order``; ``[synthetic.BACKBONE] DATASET = {SynthParams}``; ``[encode_data] DATASET = [format,
    folder]``; ``[defaults]``, keys every table of the file has unless it sets its own; and ``[[table]]``s whose
    keys are ``Table``'s fields: ``columns`` = ``Column``'s fields, ``rows`` = ``Row``'s (``method`` absent: not in
    fedfeat; ``per_dataset`` names a function of ``_PER_DATASET``). Shapes are grouped by backbone, in the order
    the files first give each."""
    docs = []
    for path in sorted(folder.glob("*.toml")):
        try:
            docs.append((tomllib.loads(path.read_text(encoding="utf-8")), path))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from e
        if not isinstance(docs[-1][0].get("order"), int):
            raise ValueError(f"{path}: no `order = N` (where its tables come in the list)")
    tables: dict[str, Table] = {}
    shapes: dict[str, dict[str, dict]] = {}
    data: dict[str, tuple[str, str]] = {}
    for doc, path in sorted(docs, key=lambda d: d[0]["order"]):
        for backbone, by_dataset in doc.get("synthetic", {}).items():
            for dataset, shape in by_dataset.items():
                if shapes.setdefault(backbone, {}).setdefault(dataset, shape) != shape:
                    raise ValueError(f"{path}: another file gives {dataset} under {backbone} another shape")
        data.update({dataset: tuple(where) for dataset, where in doc.get("encode_data", {}).items()})
        for spec in doc.get("table", []):
            spec = {**doc.get("defaults", {}), **spec}
            try:
                if spec["name"] in tables:
                    raise ValueError("a table of this name comes earlier")
                columns = [Column(**c) for c in spec["columns"]]
                table = Table(**{**spec, "columns": columns, "rows": [_row(r) for r in spec["rows"]]})
            except (TypeError, KeyError, ValueError) as e:
                why = f"no {e}" if isinstance(e, KeyError) else e
                raise ValueError(f"{path}: table {spec.get('name')!r}: {why}") from e
            tables[table.name] = table
    return tables, {(ds, bb): s for bb, by_ds in shapes.items() for ds, s in by_ds.items()}, data


# the tables by name; the synthetic stand-ins (``--synthetic``) by (dataset, backbone): ``SynthParams`` fields;
# where ``fedfeat encode`` reads a dataset for the encode commands of ``make_target``: (format, folder), others
# ``listfile``, ``~/data/NAME``
TABLES, SYNTH_SHAPES, _DATA = load_tables()


def build_hint(table: Table, dataset: str, root: Path) -> str:
    """How to build ``table``'s store of ``dataset``: its make target, or the ``fedfeat encode`` command."""
    if table.make_target.startswith("make "):
        return f"`{table.make_target}` (datasets under DATA=~/data)"
    fmt, data = _DATA.get(dataset, ("listfile", f"~/data/{dataset}"))
    return "`" + table.make_target.format(dataset=dataset, root=root, format=fmt, data=data)


def _parts(shape: dict) -> list[str]:
    """The datasets a combined stand-in is made of (a shape ``{combine = "a,b,..."}``: ``fedfeat combine``'s store of
    their stand-ins, each a domain with its own classes); [] for a plain shape."""
    return [x.strip() for x in str(shape.get("combine", "")).split(",") if x.strip()]


def _classes_of(dataset: str) -> int | None:
    """How many classes ``dataset`` has (its stand-in shapes, which follow the dataset; None: not known here)."""
    ks = set()
    for (ds, bb), shape in SYNTH_SHAPES.items():
        if ds == dataset:
            ks.add(sum(SYNTH_SHAPES[(p, bb)]["classes"] for p in _parts(shape)) if _parts(shape) else shape.get("classes"))
    return ks.pop() if len(ks) == 1 else None


def _store_problem(path, dataset: str, backbone: str) -> str | None:
    """What is wrong with ``path`` as the ``backbone`` store of ``dataset`` (None: nothing): not a store (an empty
    folder, a copy cut short), damaged or unfinished, a synthetic store, another backbone, the wrong class count
    or embedding size."""
    from fedfeat.store.featurestore import FeatureStore

    try:
        st = FeatureStore.open(path)  # a fedfeat store, complete, its metadata readable
    except FedfeatError as e:
        return str(e)
    a = st.attrs
    got = str(a.get("backbone"))
    if got == "synthetic":
        return (
            f"store {path} is a synthetic store, not {backbone} features of {dataset}; run with --synthetic for "
            "stand-ins, or encode the dataset"
        )
    safe = re.sub(r"[^A-Za-z0-9._+-]+", "_", got).strip("._")  # as `fedfeat encode` names its store files
    if safe not in (backbone, f"{backbone}-quickgelu"):
        return (
            f"store {path} holds {got} features, not {backbone}; encode {dataset} with --backbone {backbone}"
        )
    k, want = len(a.get("class_names") or ()), _classes_of(dataset)
    if want is not None and k != want:
        return f"store {path} has {k} classes, {dataset} has {want}; is it another dataset's store?"
    shape = SYNTH_SHAPES.get((dataset, backbone)) or {}
    dim = (SYNTH_SHAPES[(_parts(shape)[0], backbone)] if _parts(shape) else shape).get("dim")
    if dim is not None and a.get("embed_dim") != dim:
        return f"store {path} has D = {a.get('embed_dim')}, {backbone} gives D = {dim}; re-encode it"
    return None


def _candidates(root: Path | str, dataset: str, backbone: str) -> list:
    """``ROOT/<dataset>/<backbone>-*.zarr`` (``fedfeat encode``'s names), local or at a store URL."""
    if isinstance(root, str):  # a URL (fsspec): the stores are read there
        from fedfeat.store.urls import url_filesystem

        fs, p = url_filesystem(f"{root}/{dataset}")
        try:
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False)]
        except FileNotFoundError:
            names = []
        except OSError as e:
            raise FedfeatError(
                f"cannot list {root}/{dataset}: {e}; check the URL and your credentials"
            ) from None
        return sorted(f"{root}/{dataset}/{n}" for n in names if fnmatch.fnmatchcase(n, f"{backbone}-*.zarr"))
    d = root / dataset
    return sorted(d.glob(f"{backbone}-*.zarr")) if d.is_dir() else []


def find_store(
    root: Path | str, dataset: str, backbone: str, table: Table, synthetic: bool, log
) -> Path | str:
    """The store of ``dataset`` under ``root``: a stand-in built on first use (``synthetic``), else the encoded
    one (``ROOT/<dataset>/<backbone>-*.zarr``: the first that is a complete store of ``backbone`` features of
    ``dataset``'s classes). A missing store is a one-line error naming the make target that builds it; one that
    is there but unusable (an empty folder, damaged, unfinished, of another backbone or class count) is a one-line
    error naming it and what is wrong -- never a table of n/a."""
    if synthetic and _parts(SYNTH_SHAPES[(dataset, backbone)]):  # a federation across datasets: their stand-ins
        from fedfeat.store.combine import combine_stores

        names = _parts(SYNTH_SHAPES[(dataset, backbone)])
        parts = [find_store(root, p, backbone, table, True, log) for p in names]
        path = root / f"synth-{dataset}-{backbone.lower()}.zarr"
        combine_stores(path, parts, names, log=lambda *a: None)  # kept when already made from these parts
        return path
    if synthetic:
        from fedfeat.store.featurestore import FeatureStore, fingerprint_hash
        from fedfeat.store.synth import SynthParams, synth_fingerprint, write_synthetic_store
        from fedfeat.store.urls import is_store

        params = SynthParams(**SYNTH_SHAPES[(dataset, backbone)])
        path = root / f"synth-{dataset}-{backbone.lower()}.zarr"
        if is_store(path):
            try:
                st = FeatureStore.open(path, allow_incomplete=True)
            except FedfeatError as e:
                raise FedfeatError(
                    f"stand-in {e}; delete it (it is rebuilt) or pass another --store-root"
                ) from None
            want = fingerprint_hash(synth_fingerprint(params))
            if st.complete and st.attrs.get("fingerprint_hash") != want:
                raise FedfeatError(
                    f"{path} is not the stand-in this table needs (another synthetic store, or other parameters); "
                    "delete it (it is rebuilt) or pass another --store-root"
                )
            if st.complete:
                return path
        log(f"building the synthetic stand-in {path} (its numbers say nothing about real {dataset})")
        write_synthetic_store(path, params, stats=False, log=lambda *a: None)
        return path
    found = _candidates(root, dataset, backbone)
    if not found:
        raise FedfeatError(
            f"no {backbone} store of {dataset} under {root}/{dataset}/; build it with "
            f"{build_hint(table, dataset, root)}, pass --store-root, or run with --synthetic"
        )
    problems = []
    for path in found:
        why = _store_problem(path, dataset, backbone)
        if why is None:
            return path
        problems.append(why)
    more = f" ({len(found) - 1} other candidate(s) unusable too)" if len(found) > 1 else ""
    raise FedfeatError(
        f"no usable {backbone} store of {dataset} under {root}/{dataset}/: {problems[0]}{more}; rebuild it with "
        f"{build_hint(table, dataset, root)}, or pass --store-root"
    )


def drawable(table: Table, stores: dict[str, Path]) -> dict[int, str]:
    """Columns whose partition cannot be drawn on their store, with the partitioner's reason (FedNTD's Dirichlet
    rule never gives 100 clients >= 10 samples each at alpha = 0.05 on 10 classes: its code loops forever)."""
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.session import open_store, run_partition

    bad = {}
    for c, col in enumerate(table.columns):
        cfg = resolve_config({**table.fixed, **col.settings, "store": str(stores[col.dataset])}, None, None)
        store = open_store(cfg)  # a store that does not open is an error, not an undrawable column
        try:  # inside the sweep's session: the partition is computed once, here, and reused by its runs
            run_partition(store, cfg, False)
        except FedfeatError as e:
            bad[c] = str(e)
    return bad


def _needs(method: str) -> tuple[bool, bool]:
    """(live text encoder, pixels) that ``method``'s runs need of their store."""
    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(method)
    if cls is None:
        raise FedfeatError(f"table row method '{method}' is not registered; known: {', '.join(REGISTRY)}")
    live, pixels = cls.needs_live_text, cls.needs_pixels
    return live, pixels


def _store(row: Row, col: Column, stores: dict[str, Path], live_stores: dict | None) -> Path:
    """The store a cell runs on: a live row's live stand-in under ``--synthetic`` (``fedfeat.runs.standin``), else
    the column's."""
    if live_stores and row.method is not None and any(_needs(row.method)):
        return live_stores[col.dataset]
    return stores[col.dataset]


def runnable(
    table: Table, stores: dict[str, Path], skip=(), live_stores: dict | None = None
) -> dict[tuple[int, int], str]:
    """Cells ``(row, column)`` that cannot run, with the reason, found before any run: a row whose method fedfeat
    does not have; a prompt method (``needs_live_text``) on a store without a live encoder (a synthetic stand-in)
    or whose encoder cannot be rebuilt here (loaded now, inside the sweep's session, and reused by the runs); a
    method that re-encodes images (``fedcopl``) on a store without pixels. Columns in ``skip`` are left out."""
    from fedfeat.engine.rounds import resolve_device
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.session import live_text, open_store

    out: dict[tuple[int, int], str] = {}
    for r, row in enumerate(table.rows):
        if row.method is None:
            out.update({(r, c): row.why for c in range(len(table.columns))})
            continue
        live, pixels = _needs(row.method)
        if not (live or pixels):
            continue
        for c, col in enumerate(table.columns):
            if c in skip:
                continue
            cfg = resolve_config({**table.fixed, **col.settings, **row.settings, "method": row.method,
                                  "store": str(_store(row, col, stores, live_stores))}, None, None)  # fmt: skip
            st = open_store(cfg)
            need = ["the store's live text encoder (a real backbone and its weights)"] if live else []
            if pixels and not st.has_pixels:
                need.append("the images' pixels (`fedfeat encode ... --pixels`)")
            if st.attrs.get("backbone") in (None, "synthetic"):
                has = "neither" if len(need) > 1 else "none"
                out[(r, c)] = (
                    f"{row.method} needs {' and '.join(need)}; a synthetic stand-in store has {has} (encode "
                    "the dataset with `fedfeat encode`)"
                )
            elif pixels and not st.has_pixels:
                out[(r, c)] = (
                    f"{row.method} re-encodes images: its store needs pixels; re-encode it with --pixels"
                )
            elif live:
                try:
                    live_text(st, cfg, resolve_device(cfg.device))
                except FedfeatError as e:
                    out[(r, c)] = str(e)
    return out


def points(
    table: Table,
    stores: dict[str, Path],
    seeds: list[int],
    out: Path,
    rounds: int | None,
    skip=(),
    blocked=(),
    live_stores: dict | None = None,
) -> tuple[list, dict]:
    """The sweep points of ``table`` and, per (row, column), the indices of its points (one per seed); columns in
    ``skip`` and cells in ``blocked`` get none."""
    pts, where = [], {}
    fixed = dict(table.fixed)
    if rounds is not None:
        fixed["rounds"] = rounds
    fixed["eval_every"] = fixed[
        "rounds"
    ]  # the tables report final metrics: evaluate at rounds 0 and last only
    for r, row in enumerate(table.rows):
        done_ds: dict[str, list[int]] = {}
        done_col: dict[tuple, list[int]] = {}  # columns of one dataset and settings (other metrics) share runs
        for c, col in enumerate(table.columns):
            if (c in skip and not row.once_per_dataset) or (r, c) in blocked:
                where[(r, c)] = []
                continue
            if row.once_per_dataset and col.dataset in done_ds:
                where[(r, c)] = done_ds[col.dataset]
                continue
            same = (col.dataset, repr(sorted(col.settings.items())))
            if same in done_col:
                where[(r, c)] = done_col[same]
                continue
            params = {**row.params, **(row.per_dataset(col.dataset) if row.per_dataset else {})}
            idx = []
            for s in seeds:
                settings = {**fixed, **col.settings, **row.settings, "method": row.method, "seed": s,
                            "store": str(_store(row, col, stores, live_stores)), "out": str(out)}  # fmt: skip
                if row.once_per_dataset and "partition" not in row.settings:
                    from fedfeat.spec import scheme_params

                    settings.update({"partition": "iid", **dict.fromkeys(scheme_params())})
                    settings.pop("imbalance_factor", None)
                settings = {k: v for k, v in settings.items() if v is not None}
                idx.append(len(pts))
                pts.append((settings, dict(params)))
            where[(r, c)] = idx
            done_col[same] = idx
            if row.once_per_dataset:
                done_ds[col.dataset] = idx
    return pts, where


def _paper(table: Table, label: str, c: int, avg: bool = False) -> tuple[float | None, float | None]:
    """The paper's (value, ± std) of a cell in ours' unit (``paper_scale``); None where it prints none."""
    k = table.paper_scale
    if avg:
        p = (table.paper_avg or {}).get(label)
        return (None if p is None else round(p * k, 10)), None
    p = table.paper.get(label, [None] * len(table.columns))[c]
    sd = (table.paper_std or {}).get(label, [None] * len(table.columns))[c]
    return (None if p is None else round(p * k, 10)), (None if sd is None else round(sd * k, 10))


def _values(table: Table, key: str) -> list:
    """The distinct values of run setting ``key`` over the table's columns (a column's own, else the table's)."""
    vals = [col.settings.get(key, table.fixed.get(key)) for col in table.columns]
    return [v for v in dict.fromkeys(vals) if v is not None]


def _partition_text(table: Table) -> str:
    """Each column's partition in the registry's words (``Scheme.describe``), e.g. ``Dir(α = 0.1)``."""
    from fedfeat.partition.openvocab import PRESET_RUN
    from fedfeat.partition.registry import fill_defaults, get_scheme
    from fedfeat.spec import scheme_params

    parts = []
    for col in table.columns:
        st = {**table.fixed, **col.settings}
        if st.get("preset"):
            st = {**PRESET_RUN, **st}
        scheme = st.get("partition", "iid")
        given = fill_defaults(scheme, {k: st.get(k) for k in scheme_params() if st.get(k) is not None})
        values = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in given.items()}
        cls = get_scheme(scheme)
        after = [p.words.format(values[p.name]) for p in cls.key_parts if p.after and p.name in values]
        kind = ", ".join([cls.describe(values), *after])
        if st.get("preset"):
            kind = f"preset {st['preset']}, {kind}"
        if st.get("client_shots") is not None:
            kind = f"{st['client_shots']} shots per client class, " + kind
        if st.get("base_novel"):
            kind = "base-to-novel, " + kind
        if st.get("imbalance_factor") is not None:
            kind = f"long-tailed IF={st['imbalance_factor']:g}, " + kind
        parts.append(kind)
    return "; ".join(dict.fromkeys(parts))


def setting(table: Table, rounds: int | None = None, seeds: int | None = None) -> str:
    """One line of the table's setting: backbone, clients, participation, rounds (the paper's, and ours where
    ``--rounds`` changes them), seeds, partitions and metric -- what a reader needs to know what was run."""
    clients = ", ".join(str(c) for c in _values(table, "clients")) or "?"
    part = _values(table, "participation")
    paper_rounds = table.fixed.get("rounds")
    r = (
        f"{paper_rounds}"
        if rounds is None or rounds == paper_rounds
        else f"{rounds} (the paper's: {paper_rounds})"
    )
    out = (
        f"setting: backbone {table.backbone}; {clients} clients, "
        f"{', '.join(f'{100 * p:g} %' for p in part) or '100 %'} of them per round; rounds {r}"
    )
    if seeds is not None:
        out += f"; seeds 0..{seeds - 1}"
    out += f"; partition: {_partition_text(table)}; metric: {_metrics_text(table)}"
    return out


def list_tables(fmt: str = "markdown", name: str | None = None) -> str:
    """``fedfeat reproduce --list [NAME]``: every table's (or table ``name``'s) name, title, setting and rows (n/a
    rows with their reason). An unknown ``name`` is one line naming the known ones."""
    from fedfeat.report.tables import _table

    if name is not None and name not in TABLES:
        raise FedfeatError(f"unknown table {name!r}; known: {', '.join(TABLES)} (fedfeat reproduce --list)")
    tables = [TABLES[name]] if name is not None else list(TABLES.values())

    if fmt == "json":
        import json

        return json.dumps(
            [
                {"name": t.name, "title": t.title, "setting": setting(t), "reading": t.reading or None,
                 "columns": [c.label for c in t.columns],
                 "rows": [{"label": r.label, "method": r.method, "why": r.why or None} for r in t.rows]}
                for t in tables
            ],
            indent=1,
        )  # fmt: skip
    rows = [
        [t.name, t.title, str(len(t.columns)), ", ".join(r.label + ("" if r.method else " (n/a)") for r in t.rows),
         setting(t).removeprefix("setting: ")]
        for t in tables
    ]  # fmt: skip
    return _table(["table", "title", "columns", "rows", "setting"], rows, fmt)


def render(
    table: Table,
    summaries: list,
    where: dict,
    synthetic: bool,
    fmt: str = "markdown",
    skipped=None,
    blocked=None,
    rounds: int | None = None,
    live_note: str = "",
) -> str:
    """The paper's layout: rows = methods, columns = settings (transposed where the paper has datasets as rows);
    a cell = ours (the table's metric: mean ± std (n) over seeds) and the paper's number beside it. ``summaries``
    holds None for a run that was not made. The header states the setting (``setting``); a table of synthetic
    stand-in stores says so in its title (it is not a reproduction: its numbers say nothing about real data).

    Every number of ours carries where it comes from, in every format (``source``):

    * ``json``: a list of cells, each with ``synthetic`` (true: ours was measured on a stand-in store),
      ``source`` (``"synthetic stand-in"`` or ``"encoded store"``), ``stand_in`` (``"features"``: a feature
      stand-in, ``fedfeat synth``; ``"live"``: a live stand-in, ``fedfeat.runs.standin``; null for an encoded
      store), ``store`` (the store its runs read; null for a cell without runs) and ``reading`` (the table's
      ``reading``: what its rows are where they are not the paper's model; null where they are), beside ``mean``,
      ``std``, ``n``, ``paper`` (the paper's number, on real data), ``paper_std`` and ``why`` (an n/a cell's reason);
    * ``csv``: valid CSV (``csv`` module): the header's prose (title, setting, metric) and the n/a notes as comment
      lines starting with ``#`` (pandas: ``read_csv(..., comment="#")``; ``csv.reader``: skip rows whose first
      field starts with ``#``), then one header row and the table's rows, whose last column ``source`` says
      ``synthetic stand-in`` or ``encoded store``;
    * ``markdown``: the title (``SYNTHETIC STAND-IN, NOT A REPRODUCTION -- ...``) and the header.

    The header (markdown, and the CSV's comment lines) ends with the table's ``reading`` (``reading: ...``) and its
    ``notes`` (``note: ...``, e.g. a paper's value beside the code's that the table runs)."""
    import json

    from fedfeat.report.tables import _table

    skipped, blocked = skipped or {}, dict(blocked or {})
    source = "synthetic stand-in" if synthetic else "encoded store"

    def stand_in(r: int) -> str | None:  # which stand-in a row's runs read (None: an encoded store)
        if not synthetic:
            return None
        m = table.rows[r].method
        return "live" if live_note and m is not None and any(_needs(m)) else "features"

    stores_of: dict = {}  # (row, column) -> the store its runs read (their summaries say)
    ncol = len(table.columns)
    cells = {}
    for (r, c), idx in where.items():
        recs = [summaries[i] for i in idx if summaries[i] is not None]
        stores_of[(r, c)] = next((str(x["store"]) for x in recs if x.get("store") is not None), None)
        key = metric_of(table, c)
        got = [derived_metric(table, key, x) for x in recs]
        v = np.array([g for g in got if g is not None], dtype=np.float64)
        if recs and not len(v) and (r, c) not in blocked:
            blocked[(r, c)] = f"its runs record no {key} (a metric of another setting, or a method that trains nothing)"
        cells[(r, c)] = (
            (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else None, len(v))
            if len(v)
            else (None, None, 0)
        )
    avg = {}
    if table.paper_avg is not None:  # ours: the mean of the row's column means, where every column has one
        for r in range(len(table.rows)):
            ms = [cells[(r, c)][0] for c in range(ncol)]
            avg[r] = float(np.mean(ms)) if all(m is not None for m in ms) else None
    if fmt == "json":
        out = []
        for r, row in enumerate(table.rows):
            for c, col in enumerate(table.columns):
                p, ps = _paper(table, row.label, c)
                m, s, n = cells[(r, c)]
                why = blocked.get((r, c)) or (skipped.get(c) if m is None else None)
                out.append({"row": row.label, "column": col.label, "metric": metric_of(table, c), "mean": m, "std": s,
                            "n": n, "paper": p, "paper_std": ps, "why": why, "synthetic": synthetic,
                            "source": source, "stand_in": stand_in(r), "store": stores_of.get((r, c)),
                            "reading": table.reading or None})  # fmt: skip
            if table.paper_avg is not None:
                out.append({"row": row.label, "column": "Avg.", "metric": table.metric, "mean": avg[r],
                            "std": None, "n": ncol, "paper": _paper(table, row.label, 0, avg=True)[0],
                            "paper_std": None, "why": None, "synthetic": synthetic, "source": source,
                            "stand_in": stand_in(r), "store": None, "reading": table.reading or None})  # fmt: skip
        return json.dumps(out, indent=1)

    def num(x: float) -> str:
        return format(x, table.paper_format) if table.paper_format else str(x)

    def cell(r: int, c: int) -> str:
        m, s, _ = cells[(r, c)]
        p, ps = _paper(table, table.rows[r].label, c)
        f = OURS_FORMAT.get(metric_of(table, c), ".2f")
        ours = "n/a" if m is None else f"{m:{f}} ± {s:{f}}" if s is not None else f"{m:{f}}"
        if p is None:
            return ours
        return f"{ours} ({num(p)} ± {num(ps)})" if ps is not None else f"{ours} ({num(p)})"

    def avg_cell(r: int) -> str:
        p = _paper(table, table.rows[r].label, 0, avg=True)[0]
        ours = "-" if avg[r] is None else f"{avg[r]:.2f}"
        return f"{ours} ({num(p)})" if p is not None else ours

    if table.transpose:  # datasets as rows, methods as columns (Fed-MP's Table 1)
        cols = ["dataset"] + [row.label for row in table.rows]
        rows = [
            [col.label] + [cell(r, c) for r in range(len(table.rows))] for c, col in enumerate(table.columns)
        ]
        if table.paper_avg is not None:
            rows.append(["Average"] + [avg_cell(r) for r in range(len(table.rows))])
    else:
        cols = (
            ["method"] + [c.label for c in table.columns] + (["Avg."] if table.paper_avg is not None else [])
        )
        rows = [[row.label] + [cell(r, c) for c in range(ncol)] + ([avg_cell(r)] if table.paper_avg is not None
                else []) for r, row in enumerate(table.rows)]  # fmt: skip
    n = max((x[2] for x in cells.values()), default=0)
    title = (
        f"SYNTHETIC STAND-IN, NOT A REPRODUCTION -- {table.title} (ours on synthetic features shaped like the "
        "datasets; the paper's numbers, on real data, in parentheses for the layout only)"
        if synthetic
        else table.title
    )
    head = (
        f"{title}\n{setting(table, rounds, n or None)}\nmetric: {table.metric_label} [summary.json: {_metrics_text(table)}]; "
        f"ours: mean ± std over {n} seed(s), the paper's number (± its std where it prints one) in parentheses"
    )
    if live_note:
        head += "\n" + live_note
    if table.paper_scale != 1:
        head += f"; the paper prints fractions, shown x{table.paper_scale:g}"
    if table.paper_avg is not None:
        head += "; Avg.: the mean over the columns ('-' where a column has no number)"
    if table.reading:  # ours' rows are not the paper's model: said in the header, as each JSON cell says it
        head += "\nreading: " + table.reading
    head += "".join(f"\nnote: {x}" for x in table.notes)
    notes = "".join(f"\nn/a in {table.columns[c].label}: {why}" for c, why in skipped.items())
    by_reason: dict[tuple[int, str], list[int]] = {}
    for (r, c), why in sorted(blocked.items()):
        by_reason.setdefault((r, why), []).append(c)
    for (r, why), cs in by_reason.items():
        where_ = "all columns" if len(cs) == ncol else ", ".join(table.columns[c].label for c in cs)
        notes += f"\nn/a for {table.rows[r].label} ({where_}): {why}"
    if fmt == "csv":  # valid CSV: the prose as '#' comment lines, the label as a column of every row
        return (
            _comments(head) + _table([*cols, "source"], [[*x, source] for x in rows], fmt) + _comments(notes)
        )
    return head + "\n\n" + _table(cols, rows, fmt) + ("\n" + notes if notes else "")


def _comments(text: str) -> str:
    """``text``'s lines as CSV comment lines (``# ...``, the CSV's own line ending; a double quote, which a CSV
    reader would take for the start of a quoted field, becomes a single one)."""
    return "".join(f"# {line}\r\n".replace('"', "'") for line in text.splitlines() if line.strip())


def _refuse_empty(
    name: str, table: Table, summaries: list, where: dict, skipped: dict, blocked: dict, synthetic: bool
) -> None:
    """A table in which no cell has a number is an error (one line naming why), unless every cell is n/a for a
    documented reason: a row fedfeat does not have, a column whose partition cannot be drawn. A table with some
    numbers prints, whatever its other cells say."""
    if any(summaries[i] is not None and derived_metric(table, metric_of(table, c), summaries[i]) is not None
           for (_, c), idx in where.items() for i in idx):  # fmt: skip
        return
    for (r, c), idx in sorted(where.items()):
        row = table.rows[r]
        if row.method is None or (c in skipped and not row.once_per_dataset):
            continue
        why = blocked.get((r, c)) or (f"its runs record no {metric_of(table, c)}" if idx else "it was not run")
        raise FedfeatError(
            f"reproduce {name}: no cell has a number (e.g. {row.label} in {table.columns[c].label}: {why}); "
            + (
                "nothing was measured"
                if synthetic
                else "check the stores under --store-root, or run with --synthetic"
            )
        )


def _live(root: Path, dataset: str, backbone: str, log) -> Path:
    """The live stand-in of ``dataset`` (``fedfeat.runs.standin``); of a combined one, its parts' combined."""
    from fedfeat.runs.standin import live_standin

    names = _parts(SYNTH_SHAPES[(dataset, backbone)])
    if not names:
        return live_standin(root, dataset, SYNTH_SHAPES[(dataset, backbone)], log)
    from fedfeat.store.combine import combine_stores

    parts = [live_standin(root, p, SYNTH_SHAPES[(p, backbone)], log) for p in names]
    path = Path(root) / "live-standin" / "stores" / dataset / "combined.zarr"
    combine_stores(path, parts, names, log=lambda *a: None)
    return path


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
    progress: bool = False,
    failures: list | None = None,
) -> str:
    """Run table ``name``'s grid (finished runs are reused) and return it rendered. ``progress``: one progress
    line on stderr (``fedfeat.runs.sweep.Display``). A run that fails does not stop the others: with a
    ``failures`` list each is appended to it (``fedfeat.runs.sweep.Failure``) and its cell counts the runs that
    were made; without one, ``SweepFailed`` is raised after the others."""
    from fedfeat.report.load import load_run
    from fedfeat.runs.sweep import Display, SweepFailed, plan, run_sweep

    if name not in TABLES:
        raise FedfeatError(f"unknown table '{name}'; known: {', '.join(TABLES)}")
    if seeds < 1:
        raise FedfeatError(f"--seeds must be >= 1, got {seeds}")
    if fmt not in ("markdown", "csv", "json"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
    table = TABLES[name]
    if synthetic and any("preset" in {**table.fixed, **c.settings} for c in table.columns):
        # a stand-in's classes are class_000 ...: the preset's class list cannot be matched by name, the store's
        # order is drawn from (--class-order store)
        table = dataclasses.replace(table, fixed={**table.fixed, "class_order": "store"})
    from fedfeat.store.urls import local_path, store_location

    if synthetic:  # stand-ins are built locally; encoded stores may be read at a URL
        root = local_path(
            store_root, "--store-root", "a local folder with --synthetic (stand-ins are built in it)"
        )
    else:
        root = store_location(store_root)
    out = None if out is None else local_path(out, "--out", "a local directory for the table's runs")
    stores = {
        c.dataset: find_store(root, c.dataset, table.backbone, table, synthetic, log) for c in table.columns
    }
    out = (
        Path(out)
        if out is not None
        else Path("runs") / ("reproduce-" + (table.runs or name) + ("-synthetic" if synthetic else ""))
    )
    from fedfeat.runs.sweep import session

    live_stores, live_note = {}, ""
    live_rows = [row.label for row in table.rows if row.method is not None and any(_needs(row.method))]
    if (
        synthetic and live_rows
    ):  # prompt rows run on live stand-ins: real encoded stores of a tiny random CLIP
        from fedfeat.runs.standin import LIVE_TEST, LIVE_TRAIN

        live_stores = {c.dataset: _live(root, c.dataset, table.backbone, log) for c in table.columns}
        live_note = (
            f"{', '.join(live_rows)}: on live stand-ins (synthetic 32-px images, <= {LIVE_TRAIN} + {LIVE_TEST} per "
            "class, encoded with pixels by a tiny random CLIP, D = 32: fedfeat.runs.standin); the other rows on "
            f"feature stand-ins shaped like {table.backbone}"
        )
    with session():  # the columns' partitions, checked here, are the ones the runs use
        skipped = drawable(table, stores)
        for c, why in skipped.items():
            log(f"{table.columns[c].label}: the partition cannot be drawn ({why}); the column is left empty")
        blocked = runnable(table, stores, skip=skipped, live_stores=live_stores)
        for r in sorted({r for r, _ in blocked}):
            why = next(w for (rr, _), w in blocked.items() if rr == r)
            log(f"{table.rows[r].label}: n/a ({why})")
        pts, where = points(
            table,
            stores,
            list(range(seeds)),
            out,
            rounds,
            skip=skipped,
            blocked=blocked,
            live_stores=live_stores,
        )
        log(
            f"{name}: {len(pts)} runs ({len(table.rows)} rows x {len(table.columns)} columns x {seeds} seeds"
            + (f", {sum(1 for v in where.values() if not v)} cells n/a)" if any(not v for v in where.values())
               else ")")
        )  # fmt: skip
        # prompt methods' runs go cell by cell: one a method refuses (FedTPG in the open-vocabulary setting) or a
        # live encoder that fails is that cell's n/a, not the grid's end; the others run as one sweep (stacked)
        live = {r for r, row in enumerate(table.rows) if row.method is not None and _needs(row.method)[0]}
        paths: list = [None] * len(pts)
        safe = [i for (r, _), idx in where.items() if r not in live for i in idx]
        safe = sorted(set(safe))
        live_idx = [i for (r, _), idx in where.items() if r in live for i in idx]
        plan([pts[i] for i in safe + live_idx])  # each store/partition/RunData dropped after its last run
        display = Display(len(pts), label=name, quiet=not progress)
        failed: list = []
        if safe:
            sub: list = []
            got = run_sweep([pts[i] for i in safe], overwrite=overwrite, progress=False, log=log, failures=sub,
                            display=display)  # fmt: skip
            failed += [f._replace(index=safe[f.index]) for f in sub]
            for i, p in zip(safe, got):
                paths[i] = p
        for (r, c), idx in where.items():
            if r not in live or not idx:
                continue
            before = display.done
            try:
                got = run_sweep([pts[i] for i in idx], overwrite=overwrite, progress=False, log=log,
                                display=display)  # fmt: skip
            except FedfeatError as e:
                why = e.failures[0].error if isinstance(e, SweepFailed) else str(e)  # the run's own error
                blocked[(r, c)] = why
                log(f"{table.rows[r].label} in {table.columns[c].label}: n/a ({why})")
                display.advance(before + len(idx) - display.done)  # the cell's runs, counted as done
                continue
            for i, p in zip(idx, got):
                paths[i] = p
        display.close()
        if failed and failures is None:
            raise SweepFailed(failed)
        if failures is not None:
            failures.extend(failed)
    summaries = [None if p is None else load_run(p)[0] for p in paths]
    _refuse_empty(name, table, summaries, where, skipped, blocked, synthetic)
    return render(
        table, summaries, where, synthetic, fmt, skipped, blocked, rounds=rounds, live_note=live_note
    )


__all__ = ["TABLES", "list_tables", "reproduce", "setting"]
