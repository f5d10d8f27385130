"""Figures (matplotlib, headless ``Agg``): partition heatmaps and accuracy-vs-round curves.

A method keeps its colour and marker in every figure (``line_style``: from its name, never from the order a
figure draws it in); lines that coincide stay visible (``_draw_seed_curves``: each later line of a panel thinner,
its markers at other rounds)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError

# Type 42 (TrueType) fonts in PDF / PS, never Type 3: journals and arXiv reject Type 3 fonts
FONT_RC = {"pdf.fonttype": 42, "ps.fonttype": 42}
# figure widths (inches) of a paper's single column and full text width (ACM / IEEE / NeurIPS-style layouts)
SIZES = {"one-column": 3.3, "two-column": 7.0}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update(FONT_RC)
    return plt


def _print_rc(size: str | None) -> dict:
    """rcParams for a printed figure of ``size`` (one-column: 8 pt text, two-column: 9 pt; legend >= 8 pt)."""
    if size is None:
        return {**FONT_RC, "legend.fontsize": 8}
    if size not in SIZES:
        raise FedfeatError(f"unknown --size '{size}'; choose one-column or two-column")
    pt = 8 if size == "one-column" else 9
    return {**FONT_RC, "font.size": pt, "axes.titlesize": pt, "axes.labelsize": pt, "xtick.labelsize": pt - 1,
            "ytick.labelsize": pt - 1, "legend.fontsize": 8, "lines.linewidth": 1.2}  # fmt: skip


FORMATS = (".png", ".pdf", ".svg")
# a PNG figure's resolution (``report --dpi``): matplotlib's own default, 100, is blurred in print; 200 keeps a
# two-column figure sharp on screen and in a printed draft at a few hundred kB; journals ask 300 or more for
# raster line art (IEEE's graphics guidelines: 300 dpi), for which pass --dpi 300 or draw a vector .pdf / .svg
DPI = 200
# each run's own curve.png (``fedfeat.runs.writers``): a screen preview every run writes, kept at the 130 dpi it
# had before --dpi existed (a 200-dpi PNG takes longer to draw, in every run of a sweep)
RUN_CURVE_DPI = 130


def _save(fig, path: str | Path, tight: bool = True, dpi: int = DPI) -> None:
    """Write atomically in the format the suffix names (PNG, PDF or SVG): a half-written figure never sits at
    ``path``. ``tight=False`` keeps the figure's exact size (print widths); ``dpi``: a PNG's resolution."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise FedfeatError(f"cannot draw {path}: choose a .png, .pdf or .svg file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight" if tight else None, format=path.suffix.lower()[1:])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot_partition_heatmap(
    counts: np.ndarray, class_names: list[str], path: str | Path, title: str = ""
) -> None:
    """Client x class sample-count heatmap (``counts  # [clients, classes]``)."""
    plt = _plt()
    C, K = counts.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.35 * K, 14), min(2 + 0.12 * C, 12)))
    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if K <= 30:
        ax.set_xticks(range(K), [n[:12] for n in class_names], rotation=60, ha="right", fontsize=7)
    else:
        ax.set_xticks(_int_ticks(K))
    ax.set_yticks(_int_ticks(C))  # integer client ticks, thinned for many clients
    ax.set_title(title or "samples per client and class")
    fig.colorbar(im, ax=ax, label="samples")
    try:
        _save(fig, path)
    finally:
        plt.close(fig)


def plot_curves(
    curves: dict[str, tuple[list[int], list[float]]],
    path: str | Path,
    title: str = "",
    ylabel: str = "test accuracy (%)",
    dpi: int = RUN_CURVE_DPI,
) -> None:
    """One line per run: ``curves[label] = (rounds, values)``; each label's line style is ``line_style``'s (the
    label's first word taken as its method), rounds are whole-number ticks, a long title is wrapped."""
    import textwrap

    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    many = len(curves) > 4
    fig, ax = plt.subplots(figsize=(9.5 if many else 6.4, 4.2))
    styles = figure_styles([(label, None) for label in curves])
    for k, (label, (xs, ys)) in enumerate(curves.items()):
        st = styles[label]
        ax.plot(
            xs,
            ys,
            marker=st["marker"] if len(xs) <= 30 else None,
            markersize=3,
            label=label,
            color=st["color"],
            ls=st["ls"],
            lw=_line_width(k, 1.5),
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds: no 0.5
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 70)))
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif len(curves) > 1:
        ax.legend(fontsize=7, loc="best")
    _save(fig, path, dpi=dpi)
    plt.close(fig)


def run_title(method: str, params: dict, store: str, partition: str, seed) -> str:
    """Each run's own ``curve.png`` title, in words: the method and its hyperparameters that differ from the
    method's defaults, the store's file name, the partition (``readable_partition``) and the seed, e.g.
    ``fedavg lr=0.1 on s.zarr, Dir(α = 0.5), 5 clients, seed 0``."""
    from fedfeat.report.load import changed_params

    changed = " ".join(f"{k}={_fmt(v)}" for k, v in changed_params(method, params).items())
    words = [f"{method} {changed}".strip() + f" on {Path(str(store)).name}"]
    if partition and partition != "no-partition":
        words.append(readable_partition(partition))
    return ", ".join(words + [f"seed {seed}"])


# --------------------------------------------------------------------------------------------- line styles

# Tableau 10 (matplotlib's default colour cycle, "tab10") without its grey, which the zero-shot line uses
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
# the built-in methods in a fixed order (ours: the linear-head baselines first, as the demo draws them; the rest
# as ``fedfeat.methods`` registered them when this list was made). A method's place gives its colour and marker
# (``line_style``); a name not listed (a plugin, a method added later) is hashed to a place after these, so no
# listed method ever changes its look. Append new names; never reorder.
STYLE_ORDER = ("fedavg", "fedprox", "fedavgm", "fedntd", "fst-cbdg", "centralized", "creff", "clip2fl", "fedclip",
               "fed-mp", "promptfl", "fedtpg", "fedcopl", "copl-linear", "fednova", "fed-focal", "ratio-loss",
               "fedavg-tau-norm", "ccvr", "feddf", "fedbe", "pfedprompt", "fedopt", "zeroshot", "fedadam", "fedyogi",
               "fedadagrad", "scaffold", "feddyn", "fedncm", "fed3r", "fedcof", "fedpft", "fedkgcoop", "fedcocoop",
               "fedpgp", "promptfolio", "pfedmoap")  # fmt: skip
# (colour, marker) pairs are distinct for the first len(PALETTE) * len(MARKERS) places (9 and 10 are coprime)
_PLACES = len(PALETTE) * len(MARKERS)
# a setting's variant of a method (``fedprox mu=0.1``): the method's colour, one of these dash patterns
VARIANT_LINESTYLES = ("--", "-.", ":", (0, (5, 1.5, 1, 1.5, 1, 1.5)))


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))  # the same in every process (Python's hash() is salted)


def method_place(method: str) -> int:
    """A method's place in the style order: its index in ``STYLE_ORDER``, else a hash of its name into the places
    after those (the same in every figure, process and machine)."""
    if method in STYLE_ORDER:
        return STYLE_ORDER.index(method)
    return len(STYLE_ORDER) + _stable_hash(method) % (_PLACES - len(STYLE_ORDER))


def line_style(label: str, method: str | None = None) -> dict:
    """``{"color", "marker", "ls"}`` of a curve, from its label alone: its method (``method``, else the label's
    first word) gives the colour and, for the method's own label, the marker and a solid line; a label that names
    settings (``fedprox mu=0.1``) keeps the method's colour with a dash pattern and another marker chosen by a
    hash of the settings' text. So a method, and a setting of it, looks the same in every figure of a project."""
    method = method or (label.split()[0] if label.split() else label)
    i = method_place(method)
    color, marker = PALETTE[i % len(PALETTE)], i % len(MARKERS)
    variant = label[len(method) :].strip() if label.startswith(method) else label
    if not variant:
        return {"color": color, "marker": MARKERS[marker], "ls": "-"}
    h = _stable_hash(variant)
    return {
        "color": color,
        "marker": MARKERS[(marker + 1 + h % (len(MARKERS) - 1)) % len(MARKERS)],  # never the method's own
        "ls": VARIANT_LINESTYLES[h % len(VARIANT_LINESTYLES)],
    }


def figure_styles(labels: list[tuple[str, str | None]]) -> dict[str, dict]:
    """``{label: line_style(label, method)}`` for a figure's ``(label, method)`` pairs; where two labels would get
    the same colour and marker (two settings of a method whose hashes meet), the later one takes the next marker
    free in that colour, so no two curves of one figure look alike (up to 10 labels of one colour)."""
    out: dict[str, dict] = {}
    taken: set = set()  # (colour, marker) pairs given out
    for label, method in labels:
        if label in out:
            continue
        st = dict(line_style(label, method))
        first = MARKERS.index(st["marker"])
        for step in range(len(MARKERS)):
            marker = MARKERS[(first + step) % len(MARKERS)]
            if (st["color"], marker) not in taken:
                st["marker"] = marker
                break
        taken.add((st["color"], st["marker"]))
        out[label] = st
    return out


def _line_width(k: int, base: float) -> float:
    """The ``k``-th line of a panel: each later one thinner (a curve drawn over an identical earlier one leaves
    the earlier's edges showing), never below 45 % of the first."""
    return base * max(0.45, 1.0 - 0.12 * k)


# --------------------------------------------------------------------------------------------- partitions


def _int_ticks(n: int, max_ticks: int = 20) -> list[int]:
    """Integer tick positions 0..n-1, thinned to at most about ``max_ticks`` (always including 0)."""
    step = max(1, int(np.ceil(n / max_ticks)))
    return list(range(0, n, step))


def _draw_partition(counts: np.ndarray, class_names: list[str], view: str = "heatmap", title: str = ""):
    """The partition figure (returned open: the caller closes it). ``counts  # [clients, classes]``.

    ``heatmap``: absolute samples per client and class; ``percent``: each client's class distribution in percent
    (rows sum to 100); ``bars``: one stacked bar per client, one colour per class (legend of class names when
    K <= 20). The flwr-datasets ``plot_label_distributions`` conventions."""
    plt = _plt()
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise FedfeatError(f"partition counts must be [clients, classes], got shape {counts.shape}")
    C, K = counts.shape
    if view in ("heatmap", "percent"):
        data = counts.astype(float)
        if view == "percent":
            tot = data.sum(axis=1, keepdims=True)
            data = np.divide(100.0 * data, tot, out=np.zeros_like(data), where=tot > 0)
        fig, ax = plt.subplots(figsize=(min(3 + 0.35 * K, 14), min(2.5 + 0.15 * C, 12)))
        im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        if K <= 30:
            ax.set_xticks(range(K), [str(n)[:12] for n in class_names], rotation=60, ha="right", fontsize=7)
        else:
            ax.set_xticks(_int_ticks(K))
        ax.set_yticks(_int_ticks(C))
        ax.set_title(
            title
            or ("class distribution per client (%)" if view == "percent" else "samples per client and class")
        )
        fig.colorbar(im, ax=ax, label="% of the client's samples" if view == "percent" else "samples")
    elif view == "bars":
        fig, ax = plt.subplots(figsize=(min(4 + 0.25 * C, 16), 4.5))
        cmap = plt.get_cmap("tab20" if K > 10 else "tab10")
        colors = (
            [cmap(k % cmap.N) for k in range(K)] if K <= 20 else plt.get_cmap("viridis")(np.linspace(0, 1, K))
        )
        bottom = np.zeros(C)
        x = np.arange(C)
        for k in range(K):
            ax.bar(
                x, counts[:, k], bottom=bottom, color=colors[k], width=0.85, label=str(class_names[k])[:20]
            )
            bottom += counts[:, k]
        ax.set_xlabel("client")
        ax.set_ylabel("samples")
        ax.set_xticks(_int_ticks(C, 30))
        ax.set_xlim(-0.6, C - 0.4)
        ax.set_title(title or "samples per client, by class")
        if K <= 20:
            ax.legend(
                fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, title="class"
            )
    else:
        raise FedfeatError(f"unknown partition view {view!r}: choose heatmap, percent or bars")
    return fig


def plot_partition(
    counts: np.ndarray, class_names: list[str], path: str | Path, view: str = "heatmap", title: str = ""
) -> None:
    """Draw a partition (``view``: heatmap | percent | bars) to ``path`` (.png, .pdf or .svg)."""
    _check_suffix(path)
    plt = _plt()
    if title and readable_partition(title) != title:  # a partition key (fedfeat partition --plot): in words
        title = readable_partition(title)
    fig = _draw_partition(counts, class_names, view, title)
    try:
        _save(fig, path)
    finally:
        plt.close(fig)


def plot_partition_percent(
    counts: np.ndarray, class_names: list[str], path: str | Path, title: str = ""
) -> None:
    """Each client's class distribution in percent, as a heatmap."""
    plot_partition(counts, class_names, path, view="percent", title=title)


def plot_partition_bars(
    counts: np.ndarray, class_names: list[str], path: str | Path, title: str = ""
) -> None:
    """One stacked bar per client, one colour per class."""
    plot_partition(counts, class_names, path, view="bars", title=title)


def _check_suffix(path) -> None:
    if Path(path).suffix.lower() not in FORMATS:
        raise FedfeatError(f"cannot draw {path}: choose a .png, .pdf or .svg file name")


# --------------------------------------------------------------------------------------------- seed curves

METRIC_LABELS = {
    "test_acc": "test accuracy (%)",
    "many_acc": "many-shot accuracy (%)",
    "medium_acc": "medium-shot accuracy (%)",
    "few_acc": "few-shot accuracy (%)",
    "local_acc": "local accuracy (%)",
    "base_acc": "base accuracy (%)",
    "hm": "harmonic mean (%)",
}
_LINESTYLES = {"test_acc": "-", "many_acc": "-", "medium_acc": "--", "few_acc": ":", "local_acc": "-."}


def _setting_items(summary: dict, path=None) -> dict:
    """The run's setting (``fedfeat.report.load.run_settings``: everything but the seed, params as
    ``params.<key>``)."""
    from fedfeat.report.load import run_settings

    return run_settings(summary, path)


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def seed_groups(runs, metric: str | list[str] = "test_acc", panel_key: str = "partition") -> list[dict]:
    """Group runs that differ only in their seed. ``runs``: ``[(summary, metrics_rows), ...]`` (``collect_runs``'s
    records); returns ``[{"label", "panel", "rounds", "runs", "key", "seeds"}, ...]``, in first-seen order.

    ``runs[i]`` is one seed's values per round (rows whose ``metric`` is None are skipped, rounds evaluated by
    every seed kept); with a metric list, ``runs`` becomes ``{metric: [[...] per seed]}``. ``label`` = method + the
    settings (``k=v``) that differ between groups (settings shared by every group, and the panel key, left out);
    ``panel`` = the summary's ``panel_key`` value (``store_fingerprint`` shortened to 12 characters)."""
    metrics = [metric] if isinstance(metric, str) else list(metric)
    order: list = []
    by_key: dict = {}
    for (
        run
    ) in runs:  # (summary, rows) or (summary, rows, run directory): its config.toml then names the setting
        summary, rows = run[0], run[1]
        items = _setting_items(summary, run[2] if len(run) > 2 else None)
        key = tuple((k, repr(v)) for k, v in items.items())
        if key not in by_key:
            by_key[key] = {"items": items, "members": []}
            order.append(key)
        by_key[key]["members"].append((summary, rows))
    all_keys = sorted(
        {k for key in order for k in by_key[key]["items"]}, key=lambda k: (k.startswith("params."), k)
    )
    differing = [
        k
        for k in all_keys
        if len({repr(by_key[key]["items"].get(k)) for key in order}) > 1 and k not in ("method", panel_key)
    ]
    out = []
    for key in order:
        g = by_key[key]
        items = g["items"]
        members = sorted(g["members"], key=lambda m: (m[0].get("seed") is None, m[0].get("seed")))
        per_metric = {}
        common = None
        for m in metrics:
            ok = [{r["round"] for r in rows if r.get(m) is not None} for _, rows in members]
            rounds_m = sorted(set.intersection(*ok)) if ok else []
            common = rounds_m if common is None else sorted(set(common) & set(rounds_m))
        for m in metrics:
            per_metric[m] = [
                [next(r[m] for r in rows if r["round"] == rd) for rd in common] for _, rows in members
            ]
        extra = [f"{k.removeprefix('params.')}={_fmt(items.get(k))}" for k in differing]
        label = " ".join([str(items.get("method"))] + extra)
        panel = summary_panel(members[0][0], panel_key)
        out.append(
            {
                "label": label,
                "panel": panel,
                "rounds": list(common or []),
                "runs": per_metric[metrics[0]] if isinstance(metric, str) else per_metric,
                "seeds": [m[0].get("seed") for m in members],
                "key": dict(items),
                "method": str(items.get("method")),
            }
        )
    return out


def summary_panel(summary: dict, panel_key: str) -> str:
    v = summary.get(panel_key)
    if panel_key == "store_fingerprint" and isinstance(v, str):
        return v[:12]
    return "" if v is None else str(v)


def mean_std(runs) -> tuple[np.ndarray, np.ndarray | None]:
    """Mean over seeds and the std with ddof=1 (None for a single seed). ``runs  # [seeds, rounds]``."""
    a = np.asarray(runs, dtype=float)
    if a.ndim != 2 or a.shape[0] == 0:
        raise FedfeatError(f"a group needs [seeds, rounds] values, got shape {a.shape}")
    return a.mean(axis=0), (a.std(axis=0, ddof=1) if a.shape[0] > 1 else None)


def _fig_size(size: str | None, nr: int, nc: int) -> tuple[float, float]:
    """Figure (width, height) in inches: the print width of ``size`` split over ``nc`` panels (height from a
    panel's aspect, plus room for the legend below), or the screen default when ``size`` is None."""
    if size is None:
        return min(1.5 + 4.2 * nc, 18), min(1.2 + 3.4 * nr, 14)
    w = SIZES[size]
    panel_w = w / nc
    return w, min(0.9 + nr * max(1.6, 0.8 * panel_w), 9.0)


def _one_legend(fig, axes, force: bool = False) -> None:
    """One legend for the whole figure, below the panels (each label once, in first-drawn order), >= 8 pt, in as
    many columns as fit the figure's width; the figure grows by the legend's height (panels keep theirs). A single
    curve gets none unless ``force`` (its entry says something: a diverged run)."""
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if not (len(seen) > 1 or "zero-shot" in seen or (force and seen)):
        return
    fs = _plt().rcParams["legend.fontsize"]
    fs = max(8.0, float(fs)) if isinstance(fs, (int, float)) else 8.0  # never below 8 pt
    w_pt = fig.get_size_inches()[0] * 72
    col_pt = 0.55 * fs * max(len(t) for t in seen) + 3.5 * fs  # text + handle + gap, about
    ncol = max(1, min(len(seen), int(w_pt // col_pt)))
    rows = -(-len(seen) // ncol)
    w, h = fig.get_size_inches()
    fig.set_size_inches(w, h + (rows * 1.45 * fs + fs) / 72)
    fig.legend(
        list(seen.values()), list(seen), loc="outside lower center", ncol=ncol, frameon=False, fontsize=fs
    )


def _title(ax, text: str, fig, nc: int) -> None:
    """A panel title, wrapped to the panel's width."""
    import textwrap

    fs = ax.title.get_fontsize()
    chars = max(12, int(fig.get_size_inches()[0] / nc * 72 / (0.55 * fs)))
    ax.set_title("\n".join(textwrap.wrap(text, chars)) if len(text) > chars else text)


def _draw_seed_curves(
    groups: list[dict],
    *,
    reference=None,
    title: str | None = None,
    metric: str | list[str] = "test_acc",
    size: str | None = None,
):
    """The figure (returned open). One panel per distinct ``panel`` value (first-seen order; with a metric list,
    one panel per (panel, metric): metrics as rows, panels as columns), y axis shared; per group the mean over
    seeds with a shaded ± std band (ddof=1; none when n = 1); ONE legend for the figure, below the panels, reads
    "label (n=seeds)" (", k diverged" where a group's ``diverged`` count is > 0). ``reference``: the zero-shot
    level, drawn dashed as "zero-shot": a number or ``{panel: number}`` (the overall accuracy: on every row of a
    one-metric figure, on the ``test_acc`` row of a metric list), or ``{panel: {metric: number}}`` (each row its
    own: zero-shot's many / medium / few accuracy on those rows; a row without a number gets no line). ``size``:
    one-column / two-column print widths (:data:`SIZES`), or None for a screen figure.

    Each group's look is ``line_style``'s for its label (and ``method``), the same in every figure; within a panel
    each later line is thinner and its markers sit at other rounds (``markevery`` offset), so that curves that
    coincide (two methods that learn the same thing) all stay visible."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    if not groups:
        raise FedfeatError("no runs to plot")
    metrics = [metric] if isinstance(metric, str) else list(metric)
    panels = list(dict.fromkeys(str(g.get("panel", "")) for g in groups))
    style = figure_styles([(g["label"], g.get("method")) for g in groups])
    seeds_of: dict = {}  # label -> seed counts over its panels: one legend entry per label, "n=3" or "n=2-3"
    diverged: dict = {}  # label -> diverged runs over its panels
    for g in groups:
        v = g["runs"] if isinstance(metric, str) else g["runs"][metrics[0]]
        seeds_of.setdefault(g["label"], set()).add(len(v))
        diverged[g["label"]] = diverged.get(g["label"], 0) + int(g.get("diverged") or 0)
    legend_text = {
        lab: f"{lab} (n={min(ns)}"
        + (f"–{max(ns)}" if len(ns) > 1 else "")
        + (f", {diverged[lab]} diverged" if diverged[lab] else "")
        + ")"
        for lab, ns in seeds_of.items()
    }
    base_lw = float(plt.rcParams["lines.linewidth"]) * 1.2
    nr, nc = len(metrics), len(panels)
    fig, axes = plt.subplots(
        nr, nc, figsize=_fig_size(size, nr, nc), sharey=True, squeeze=False, layout="constrained"
    )
    for i, m in enumerate(metrics):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            k = 0  # the line's place in this panel
            for g in groups:
                if str(g.get("panel", "")) != panel:
                    continue
                vals = g["runs"] if isinstance(metric, str) else g["runs"][m]
                if not len(vals) or not len(g["rounds"]):
                    continue
                mean, std = mean_std(vals)
                xs = np.asarray(g["rounds"], dtype=float)
                st = style[g["label"]]
                every = max(1, int(np.ceil(len(xs) / 10)))  # about 10 markers a line
                ax.plot(xs, mean, color=st["color"], ls=st["ls"], marker=st["marker"],
                        markevery=(k % every, every), ms=max(3.0, 5.5 - 0.5 * k), lw=_line_width(k, base_lw),
                        label=legend_text[g["label"]], zorder=2.0 + 0.01 * k)  # fmt: skip
                if std is not None:
                    ax.fill_between(xs, mean - std, mean + std, color=st["color"], alpha=0.2, lw=0)
                k += 1
            ref = _reference_for(reference, panel, m, len(metrics) > 1)
            if ref is not None:
                ax.axhline(float(ref), color="0.3", ls="--", lw=1.0, label="zero-shot")
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds: no 2.5
            if i == nr - 1:
                ax.set_xlabel("round")
            if j == 0:
                ax.set_ylabel(METRIC_LABELS.get(m, m))
            if i == 0 and (nc > 1 or panel):
                _title(ax, panel, fig, nc)
    _one_legend(fig, [ax for row in axes for ax in row], force=any(diverged.values()))
    if title:
        import textwrap

        fs = plt.rcParams["figure.titlesize"]
        fs = float(fs) if isinstance(fs, (int, float)) else 12.0
        chars = max(20, int(fig.get_size_inches()[0] * 72 / (0.55 * fs)))
        fig.suptitle("\n".join(textwrap.wrap(title, chars)))
    return fig


def _reference_for(reference, panel: str, metric: str, several: bool):
    """The zero-shot level of one panel's row (``_draw_seed_curves``'s ``reference``), or None."""
    ref = reference.get(panel) if isinstance(reference, dict) else reference
    if isinstance(ref, dict):
        return ref.get(metric)
    return ref if not several or metric == "test_acc" else None


def _panel_title(panel_key: str, value) -> str:
    """A panel's title: a partition key as :func:`readable_partition` words, other keys as ``key: value``."""
    if value in ("", None):
        return ""
    return readable_partition(str(value)) if panel_key == "partition" else f"{panel_key}: {value}"


def plot_seed_curves(
    groups: list[dict],
    path: str | Path,
    *,
    panel_key: str = "partition",
    reference=None,
    title: str | None = None,
    metric: str | list[str] = "test_acc",
    size: str | None = None,
    dpi: int = DPI,
) -> None:
    """Mean ± std over seeds per group, one panel per ``panel`` value, to ``path`` (.png, .pdf or .svg; ``dpi``:
    a PNG's resolution, ``DPI`` by default).

    ``groups``: ``[{"label": str, "panel": str, "rounds": [r...], "runs": [[value per round] per seed]}]`` (as
    :func:`seed_groups` makes them; ``panel_key`` names what ``panel`` holds: partition keys become readable
    titles, ``readable_partition``). ``metric`` a list (e.g. ``["many_acc", "medium_acc", "few_acc"]``,
    long-tailed runs): ``runs`` is then ``{metric: [[...] per seed]}`` and each metric gets its own row of panels.
    ``size``: ``one-column`` (3.3 in) or ``two-column`` (7 in) print width, fonts sized for print. PDFs embed
    TrueType (Type 42) fonts."""
    _check_suffix(path)
    plt = _plt()
    with plt.rc_context(_print_rc(size)):
        named = [dict(g, panel=_panel_title(panel_key, g.get("panel", ""))) for g in groups]
        ref = (
            {_panel_title(panel_key, k): v for k, v in reference.items()}
            if isinstance(reference, dict)
            else reference
        )
        fig = _draw_seed_curves(named, reference=ref, title=title, metric=metric, size=size)
        try:
            _save(fig, path, tight=size is None, dpi=dpi)
        finally:
            plt.close(fig)


def plot_group_curves(groups: list[dict], path: str | Path, **kw) -> None:
    """Long-tailed runs: many / medium / few-shot accuracy, one row of panels each (``seed_groups(runs,
    metric=["many_acc", "medium_acc", "few_acc"])`` makes the groups)."""
    kw.setdefault("metric", ["many_acc", "medium_acc", "few_acc"])
    plot_seed_curves(groups, path, **kw)


# --------------------------------------------------------------------------------------------- readable labels


def readable_partition(key: str) -> str:
    """A partition key (``fedfeat.partition.core.partition_key``) in words, for panel titles:

    >>> readable_partition("dirichlet-a0.1-c100-s19940817")
    'Dir(α = 0.1), 100 clients'
    >>> readable_partition("lt100+shard-sh2-c10-s7")
    'LT IF=100, 2 shards per client, 10 clients'

    The words are each scheme's (``Scheme.describe`` and its key parts, ``fedfeat.partition.registry``); the
    partition seed is named only when it is not the scheme's default (``default_seed``); a key of a name no scheme
    has is read with every scheme's key parts; a key in no known format comes back unchanged."""
    from fedfeat.partition.registry import describe_generic, parse_key

    k = parse_key(key)
    if k is None:
        return str(key)
    cls, values, imb = k["cls"], k["values"], k["imbalance_factor"]
    before = [p for p in k["parts"] if not p.after]
    words = cls.describe(values) if cls is not None else describe_generic(k["scheme"], before, values)
    n = k["clients"]
    proto = (["base-to-novel"] if k.get("base_novel") else []) + (
        [f"{k['client_shots']} shots per client class"] if k.get("client_shots") else []
    )
    parts = ([f"LT IF={imb}"] if imb else []) + proto + [words, f"{n} client{'s' if n != '1' else ''}"]
    if k["seed"] is not None:
        dflt = None if cls is None else cls.default_seed(float(imb) if imb else None)
        if int(k["seed"]) != dflt:
            parts.append(f"seed {k['seed']}")
    parts += [p.words.format(values[p.name]) for p in k["parts"] if p.after and p.name in values]
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------- per-client figure


def _draw_clients(groups: list[dict], *, size: str | None = None, frac: float = 0.1):
    """Per-client accuracy, sorted from best to worst, one panel per ``panel`` (the figure, returned open).

    ``groups``: ``[{"label", "panel", "acc": [[acc per client] per seed]}]``: each seed's vector (NaN = a client
    without local test rows, left out) is sorted descending; the line is the rank-wise mean over seeds (± std band
    with n > 1 seeds of equal client counts), the x axis the client's rank as a fraction of the clients (0 best,
    1 worst) so that client counts may differ. The legend gives the mean of the worst ``frac`` of clients."""
    plt = _plt()
    if not groups:
        raise FedfeatError(
            "no runs with per-client results (results.npz client_acc; train with --local-test)"
        )
    panels = list(dict.fromkeys(str(g.get("panel", "")) for g in groups))
    style = figure_styles([(g["label"], g.get("method")) for g in groups])
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=_fig_size(size, 1, len(panels)),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    for j, panel in enumerate(panels):
        ax = axes[0][j]
        k = 0
        for g in groups:
            if str(g.get("panel", "")) != panel:
                continue
            st = style[g["label"]]
            vecs = [np.sort(np.asarray(a, float)[~np.isnan(np.asarray(a, float))])[::-1] for a in g["acc"]]
            vecs = [v for v in vecs if len(v)]
            if not vecs:
                continue
            n = min(len(v) for v in vecs)
            if len({len(v) for v in vecs}) > 1:  # unequal client counts: each seed's curve on its own
                vecs = [np.interp(np.linspace(0, 1, n), np.linspace(0, 1, len(v)), v) for v in vecs]
            mean, std = mean_std(np.stack(vecs))
            worst = float(np.mean([np.mean(v[::-1][: max(1, int(np.ceil(frac * len(v))))]) for v in vecs]))
            xs = np.linspace(0, 1, n) if n > 1 else np.zeros(1)
            lab = f"{g['label']} (n={len(vecs)}; worst {frac:.0%}: {worst:.1f})"
            ax.plot(xs, mean, color=st["color"], ls=st["ls"], lw=_line_width(k, 1.6), label=lab,
                    marker=st["marker"] if n <= 20 else None, ms=3)  # fmt: skip
            if std is not None:
                ax.fill_between(xs, mean - std, mean + std, color=st["color"], alpha=0.2, lw=0)
            k += 1
        ax.grid(alpha=0.3)
        ax.set_xlabel("client rank (best → worst, fraction of clients)")
        if j == 0:
            ax.set_ylabel("local test accuracy (%)")
        if panel:
            _title(ax, panel, fig, len(panels))
    _one_legend(fig, [a for row in axes for a in row])
    return fig


def plot_clients(
    groups: list[dict],
    path: str | Path,
    *,
    panel_key: str = "partition",
    size: str | None = None,
    dpi: int = DPI,
) -> None:
    """The per-client figure (:func:`_draw_clients`) to ``path`` (.png, .pdf or .svg); partition panels get
    readable titles; ``size`` and ``dpi`` as in :func:`plot_seed_curves`."""
    _check_suffix(path)
    plt = _plt()
    with plt.rc_context(_print_rc(size)):
        named = [dict(g, panel=_panel_title(panel_key, g.get("panel", ""))) for g in groups]
        fig = _draw_clients(named, size=size)
        try:
            _save(fig, path, tight=size is None, dpi=dpi)
        finally:
            plt.close(fig)


def plot_privacy(groups: list[dict], path: str | Path, *, size: str | None = None, dpi: int = DPI) -> None:
    """The privacy-utility figure (``fedfeat report --plot F --kind privacy``; ``report.tables.privacy_groups``): one
    panel per partition, final accuracy against the epsilon each setting spent (log scale), a line per method and DP
    level with ± std bars over seeds, and the method's non-private accuracy as a dotted line of its colour."""
    _check_suffix(path)
    plt = _plt()
    if not groups:
        raise FedfeatError("--kind privacy: no differentially private runs to draw")
    with plt.rc_context(_print_rc(size)):
        panels = list(dict.fromkeys(str(g["panel"]) for g in groups))
        style = figure_styles([(g["label"], g["method"]) for g in groups])
        fig, axes = plt.subplots(1, len(panels), figsize=_fig_size(size, 1, len(panels)), sharey=True,
                                 squeeze=False, layout="constrained")  # fmt: skip
        for j, panel in enumerate(panels):
            ax = axes[0][j]
            for k, g in enumerate(g for g in groups if str(g["panel"]) == panel):
                st = style[g["label"]]
                xs = [p[0] for p in g["points"]]
                ys = [p[1] for p in g["points"]]
                err = [p[2] or 0.0 for p in g["points"]]
                n = max(p[3] for p in g["points"])
                ax.errorbar(xs, ys, yerr=err if n > 1 else None, color=st["color"], ls="-", marker=st["marker"],
                            ms=4, lw=_line_width(k, 1.6), capsize=2, label=f"{g['label']} (n={n})")  # fmt: skip
                if g["plain"] is not None:
                    ax.axhline(g["plain"], color=st["color"], ls=":", lw=1.0, label=f"{g['method']}, no DP")
            ax.set_xscale("log")
            ax.grid(alpha=0.3, which="both")
            ax.set_xlabel("epsilon spent (log scale)")
            if j == 0:
                ax.set_ylabel("final test accuracy (%)")
            _title(ax, _panel_title("partition", panel), fig, len(panels))
        _one_legend(fig, [a for row in axes for a in row], force=True)
        try:
            _save(fig, path, tight=size is None, dpi=dpi)
        finally:
            plt.close(fig)
