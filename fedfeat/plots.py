"""Figures (matplotlib, headless ``Agg``): partition heatmaps and accuracy-vs-round curves."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


FORMATS = (".png", ".pdf", ".svg")


def _save(fig, path: str | Path) -> None:
    """Write atomically in the format the suffix names (PNG, PDF or SVG): a half-written figure never sits at
    ``path``."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise FedfeatError(f"cannot draw {path}: choose a .png, .pdf or .svg file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=130, bbox_inches="tight", format=path.suffix.lower()[1:])
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
    ax.set_title(title or "samples per client and class")
    fig.colorbar(im, ax=ax, label="samples")
    _save(fig, path)
    plt.close(fig)


def plot_curves(
    curves: dict[str, tuple[list[int], list[float]]],
    path: str | Path,
    title: str = "",
    ylabel: str = "test accuracy (%)",
) -> None:
    """One line per run: ``curves[label] = (rounds, values)``."""
    plt = _plt()
    many = len(curves) > 4
    fig, ax = plt.subplots(figsize=(9.5 if many else 6.4, 4.2))
    cmap = plt.get_cmap("tab20" if len(curves) > 10 else "tab10")
    for i, (label, (xs, ys)) in enumerate(curves.items()):
        ax.plot(
            xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=label, color=cmap(i % cmap.N)
        )
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif len(curves) > 1:
        ax.legend(fontsize=7, loc="best")
    _save(fig, path)
    plt.close(fig)
