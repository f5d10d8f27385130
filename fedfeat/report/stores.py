"""Human-facing output: store info tables, partition statistics, plots.

Library functions here take paths and options and print with ``rich``; the CLI calls exactly one of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from fedfeat.errors import FedfeatError
from fedfeat.partition.stored import store_partition
from fedfeat.store.featurestore import FeatureStore
from fedfeat.store.urls import storage_error


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False, width=120)


def _stderr_line(msg: str) -> None:
    print(msg, file=sys.stderr)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_store_info(path: str | Path, *, as_json: bool = False, verify: bool = False) -> None:
    """``fedfeat info``: attributes, split sizes, partitions of a store (incomplete ones included).

    Opens the store read-only (works on read-only filesystems, writes nothing). ``verify``: first check every
    attribute against the arrays (shapes, dtypes, counts, class ids, fingerprint fields, partitions), then every
    written chunk, the labels, the text features and the partitions against their checksums and for finite
    values (``FeatureStore.verify``). Each attribute disagreement is printed on stderr, one line each, before the
    one-line error; a damaged chunk is a one-line error naming the split, chunk and rows. Without ``verify``, a
    store whose attributes disagree with its arrays' shapes is refused in one line (as ``train`` refuses it).
    """
    st = FeatureStore.open(path, allow_incomplete=True, check=not verify)
    checked = st.verify(log=_stderr_line) if verify else None
    try:
        summ = st.summary()
    except OSError as e:
        raise storage_error(e, path, "reading the store", "check the path and its permissions") from None
    if checked is not None:
        summ["verified"] = checked
    if as_json:
        print(json.dumps(summ, indent=2, default=str))
        return
    a = summ["attrs"]
    con = _console()
    t = Table(title=f"store {st.path}", show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    status = (
        "complete" if st.complete else "[red]INCOMPLETE[/red] (resume with the same `fedfeat encode` command)"
    )
    t.add_row("status", status)
    t.add_row("format version", str(a["format_version"]))
    t.add_row("backbone / weights", f"{a['backbone']} / {a['pretrained']}")
    t.add_row("embed dim / logit scale", f"{a['embed_dim']} / {a['logit_scale']:g}")
    names = a["class_names"]
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    t.add_row("classes", f"{len(names)}: {shown}")
    t.add_row(
        "templates",
        f"{len(a['templates'])}: {a['templates'][0]!r}" + (", ..." if len(a["templates"]) > 1 else ""),
    )
    for split, n in a["splits"].items():
        done = st.done_chunks(split)
        t.add_row(
            f"split {split}", f"{n} x {a['embed_dim']} float16, {int(done.sum())}/{len(done)} chunks written"
        )
    t.add_row("fingerprint", a.get("fingerprint_hash", "?"))
    t.add_row("size on disk", _human_bytes(summ["bytes_on_disk"]))
    if checked is not None:
        t.add_row(
            "verified",
            f"{checked['chunks']} feature chunks ({checked['rows']} rows), labels"
            + (", text features" if checked.get("text") else "")
            + ": checksums match, all finite; attributes agree with the arrays"
            + (f"; {len(summ['partitions'])} partition(s) match" if summ["partitions"] else ""),
        )
    if "synthetic_stats" in a:
        s = a["synthetic_stats"]
        t.add_row("synthetic stats", ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
    con.print(t)
    parts = summ["partitions"]
    if parts:
        pt = Table(title="partitions", title_justify="left")
        for col in ("key", "scheme", "split", "clients", "samples", "seed"):
            pt.add_column(col)
        for k, p in parts.items():
            pt.add_row(
                k, p["scheme"], p["split"], str(p["clients"]), str(p["samples"]), str(p["params"].get("seed"))
            )
        con.print(pt)
    else:
        con.print("partitions: none stored (make one with `fedfeat partition`)")


def partition_command(
    path: str | Path,
    *,
    scheme: str,
    clients: int,
    imbalance_factor: float | None,
    seed: int | None,
    split: str,
    stats: bool,
    export: Path | None,
    plot: Path | None,
    view: str = "heatmap",
    save: bool,
    **scheme_params,
) -> None:
    """``fedfeat partition``: compute, store, describe, export and plot a partition.

    ``scheme_params``: the scheme parameters as given (``alpha``, ``shards``, ``shots``, ...: every name of
    ``fedfeat.partition.registry.scheme_fields()``; None = not given, the scheme's default)."""
    import fedfeat.partition as P

    if view not in ("heatmap", "percent", "bars"):
        raise FedfeatError(f"unknown --view '{view}'; choose heatmap, percent or bars")
    for flag, target in (("--export", export), ("--plot", plot)):  # before any work or any write
        if target is not None and not Path(target).parent.is_dir():
            raise FedfeatError(
                f"cannot write {target}: directory {Path(target).parent} does not exist; create it first "
                f"or choose another {flag} path"
            )
    st = FeatureStore.open(path, mode="r+" if save else "r")
    try:
        key, part = store_partition(
            st,
            scheme=scheme,
            clients=clients,
            imbalance_factor=imbalance_factor,
            seed=seed,
            split=split,
            save=save,
            **scheme_params,
        )
    except OSError as e:
        raise storage_error(
            e, path, "saving the partition", "pass --no-save to use the partition without storing it"
        ) from None
    labels = st.labels(split)
    counts = part.counts(np.maximum(labels, 0), st.n_classes)  # [clients, classes]
    sizes = part.sizes()
    con = _console()
    con.print(
        f"partition [bold]{key}[/bold] of {path} ({split}): {part.n_clients} clients, {int(sizes.sum())} of "
        f"{len(labels)} samples assigned; client sizes min {sizes.min()} / median {int(np.median(sizes))} / "
        f"max {sizes.max()}; classes per client min {(counts > 0).sum(1).min()} / max {(counts > 0).sum(1).max()}"
        + (" (stored)" if save else "")
    )
    if stats:
        print_partition_stats(counts, st.class_names)
    try:
        if export is not None:
            P.to_json(part, export, store_fingerprint=st.attrs.get("fingerprint_hash"))
            con.print(f"exported client indices to {export}")
        if plot is not None:
            from fedfeat.report.plots import plot_partition

            plot_partition(counts, st.class_names, plot, view=view, title=key)
            con.print(f"plot: {plot}")
    except OSError as e:
        raise storage_error(e, e.filename or export or plot, "writing the export/plot") from None


def print_partition_stats(counts: np.ndarray, class_names: list[str]) -> None:
    """Per-client sample and class counts as a table (``counts  # [clients, classes]``)."""
    con = _console()
    K = counts.shape[1]
    wide = K <= 20
    t = Table(title="per-client counts", title_justify="left")
    t.add_column("client", justify="right")
    t.add_column("samples", justify="right")
    t.add_column("classes", justify="right")
    if wide:
        for name in class_names:
            t.add_column(name[:8], justify="right")
    else:
        t.add_column("top classes (count)")
    for i, row in enumerate(counts):
        cells = [str(i), str(int(row.sum())), str(int((row > 0).sum()))]
        if wide:
            cells += [str(int(v)) if v else "." for v in row]
        else:
            top = np.argsort(-row)[:5]
            cells.append(", ".join(f"{class_names[k]} ({row[k]})" for k in top if row[k]))
        t.add_row(*cells)
    con.print(t)
