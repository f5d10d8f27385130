"""Figures: seed-averaged curves (mean ± std bands, panels, legends, reference line), partition views, formats."""

from __future__ import annotations

import numpy as np
import pytest

from fedfeat.errors import FedfeatError
from fedfeat.report import plots

ROUNDS = [1, 2, 3]
A = [[10.0, 20.0, 30.0], [12.0, 22.0, 35.0], [14.0, 27.0, 31.0]]
B = [[50.0, 51.0, 52.0], [40.0, 45.0, 60.0], [45.0, 48.0, 50.0]]


def _groups():
    return [
        {"label": "fedavg", "panel": "iid", "rounds": ROUNDS, "runs": A},
        {"label": "fst-cbdg", "panel": "dir0.1", "rounds": ROUNDS, "runs": B},
    ]


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_seed_curves_mean_and_std_band():
    fig = plots._draw_seed_curves(_groups(), reference={"iid": 33.0, "dir0.1": 44.0})
    try:
        axes = fig.axes
        assert len(axes) == 2  # one panel per distinct panel value
        for ax, runs in zip(axes, (A, B), strict=True):
            a = np.asarray(runs)
            mean, std = a.mean(0), a.std(0, ddof=1)
            line = next(ln for ln in ax.get_lines() if "n=3" in ln.get_label())
            np.testing.assert_allclose(line.get_xdata(), ROUNDS)
            np.testing.assert_allclose(line.get_ydata(), mean)
            (band,) = ax.collections
            verts = band.get_paths()[0].vertices
            ys = verts[:, 1]
            # the band's polygon runs along mean+std and mean-std; its extremes are those curves
            for x, lo, hi in zip(ROUNDS, mean - std, mean + std, strict=True):
                at = ys[np.isclose(verts[:, 0], x)]
                assert np.isclose(at.min(), lo) and np.isclose(at.max(), hi)
        assert all(ax.get_legend() is None for ax in axes) and len(fig.legends) == 1  # one legend per figure
        texts = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "fedavg (n=3)" in texts and "fst-cbdg (n=3)" in texts
        refs = [[ln for ln in ax.get_lines() if ln.get_label() == "zero-shot"] for ax in axes]
        assert np.allclose(refs[0][0].get_ydata(), 33.0) and np.allclose(refs[1][0].get_ydata(), 44.0)
        assert refs[0][0].get_linestyle() == "--"
        assert axes[0].get_ylabel() == "test accuracy (%)"
        assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])
        assert all(float(t).is_integer() for t in axes[0].get_xticks())  # integer rounds
    finally:
        _close(fig)


def test_single_seed_has_no_band_and_panels_count():
    groups = [
        {"label": "a", "panel": "p1", "rounds": ROUNDS, "runs": [A[0]]},
        {"label": "b", "panel": "p1", "rounds": ROUNDS, "runs": A},
        {"label": "a", "panel": "p2", "rounds": ROUNDS, "runs": B},
        {"label": "a", "panel": "p3", "rounds": ROUNDS, "runs": B},
    ]
    fig = plots._draw_seed_curves(groups, reference=50.0)
    try:
        assert len(fig.axes) == 3
        assert len(fig.axes[0].collections) == 1  # only b's band; a has n=1
        labels = [t.get_text() for t in fig.legends[0].get_texts()]  # one legend: a's seed counts over panels
        assert labels == ["a (n=1–3)", "b (n=3)", "zero-shot"]
    finally:
        _close(fig)


def test_metric_list_draws_a_row_per_metric():
    groups = [
        {
            "label": "m",
            "panel": "lt",
            "rounds": ROUNDS,
            "runs": {"many_acc": A, "medium_acc": B, "few_acc": A},
        }
    ]
    fig = plots._draw_seed_curves(groups, metric=["many_acc", "medium_acc", "few_acc"])
    try:
        assert len(fig.axes) == 3
        assert [ax.get_ylabel() for ax in fig.axes] == [
            "many-shot accuracy (%)",
            "medium-shot accuracy (%)",
            "few-shot accuracy (%)",
        ]
        np.testing.assert_allclose(fig.axes[1].get_lines()[0].get_ydata(), np.mean(B, 0))
    finally:
        _close(fig)


def _run(method, seed, partition="iid", lr=0.1, accs=(10.0, 20.0), **extra):
    s = {
        "method": method,
        "seed": seed,
        "partition": partition,
        "store_fingerprint": "abc",
        "rounds": len(accs),
        "clients": 10,
        "participation": 1.0,
        "params": {"lr": lr, "epochs": 1},
        **extra,
    }
    rows = [{"round": i + 1, "test_acc": a, "many_acc": a / 2} for i, a in enumerate(accs)]
    return s, rows


def test_seed_groups_groups_seeds_and_labels_differences():
    runs = [
        _run("fedavg", 0, lr=0.1, accs=(1.0, 2.0)),
        _run("fedavg", 1, lr=0.1, accs=(3.0, 4.0)),
        _run("fedavg", 0, lr=0.01),
        _run("fedavg", 0, lr=0.1, partition="dir0.1"),
        _run("fst", 2, lr=0.1),
        _run("fst", 1, lr=0.1),
    ]
    groups = plots.seed_groups(runs)
    assert [(g["label"], g["panel"], len(g["runs"])) for g in groups] == [
        ("fedavg lr=0.1", "iid", 2),
        ("fedavg lr=0.01", "iid", 1),
        ("fedavg lr=0.1", "dir0.1", 1),
        ("fst lr=0.1", "iid", 2),
    ]
    assert groups[0]["runs"] == [[1.0, 2.0], [3.0, 4.0]] and groups[0]["rounds"] == [1, 2]
    assert groups[3]["seeds"] == [1, 2]
    assert "epochs" not in groups[0]["label"] and "clients" not in groups[0]["label"]
    lt = plots.seed_groups(runs[:2], metric=["many_acc"])
    assert lt[0]["runs"]["many_acc"] == [[0.5, 1.0], [1.5, 2.0]]
    assert lt[0]["label"] == "fedavg"


def test_seed_groups_skips_unevaluated_rounds():
    s, rows = _run("fedavg", 0, accs=(1.0, 2.0, 3.0))
    rows[1]["test_acc"] = None
    (g,) = plots.seed_groups([(s, rows)])
    assert g["rounds"] == [1, 3] and g["runs"] == [[1.0, 3.0]]


def _is_int_labels(labels):
    return all(t.get_text().lstrip("−-").isdigit() for t in labels if t.get_text())


@pytest.mark.parametrize("view", ["heatmap", "percent"])
def test_partition_heatmap_ticks_are_integers(view):
    counts = np.arange(7 * 45).reshape(7, 45) % 13
    fig = plots._draw_partition(counts, [f"c{k}" for k in range(45)], view)
    try:
        ax = fig.axes[0]
        fig.canvas.draw()
        assert all(float(t).is_integer() for t in ax.get_yticks())
        assert all(float(t).is_integer() for t in ax.get_xticks())
        assert _is_int_labels(ax.get_yticklabels()) and _is_int_labels(ax.get_xticklabels())
        if view == "percent":
            np.testing.assert_allclose(ax.images[0].get_array().sum(1), 100.0)
    finally:
        _close(fig)


def test_partition_ticks_thinned_for_many_clients():
    fig = plots._draw_partition(np.ones((200, 5)), list("abcde"), "heatmap")
    try:
        ticks = fig.axes[0].get_yticks()
        assert 2 <= len(ticks) <= 21 and all(float(t).is_integer() for t in ticks)
    finally:
        _close(fig)


def test_partition_bars_stack_and_legend():
    counts = np.array([[3, 1, 0], [0, 2, 5]])
    fig = plots._draw_partition(counts, ["cat", "dog", "eel"], "bars")
    try:
        ax = fig.axes[0]
        heights = np.array([p.get_height() for p in ax.patches]).reshape(3, 2)
        np.testing.assert_allclose(heights, counts.T)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["cat", "dog", "eel"]
        assert all(float(t).is_integer() for t in ax.get_xticks())
    finally:
        _close(fig)
    fig = plots._draw_partition(np.ones((3, 25)), [str(k) for k in range(25)], "bars")
    try:
        assert fig.axes[0].get_legend() is None  # K > 20: no legend
    finally:
        _close(fig)
    with pytest.raises(FedfeatError, match="heatmap, percent or bars"):
        plots._draw_partition(counts, ["a", "b", "c"], "pie")


def test_formats(tmp_path):
    counts = np.array([[3, 1], [0, 2]])
    plots.plot_seed_curves(_groups(), tmp_path / "c.pdf", reference=30.0, title="t")
    assert (tmp_path / "c.pdf").read_bytes().startswith(b"%PDF")
    plots.plot_partition(counts, ["a", "b"], tmp_path / "p.svg", view="bars")
    assert "<svg" in (tmp_path / "p.svg").read_text()
    plots.plot_partition_percent(counts, ["a", "b"], tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes().startswith(b"\x89PNG")
    plots.plot_partition_bars(counts, ["a", "b"], tmp_path / "b.pdf")
    plots.plot_partition_heatmap(counts, ["a", "b"], tmp_path / "h.png", title="x")
    plots.plot_curves({"a": ([1, 2], [3.0, 4.0])}, tmp_path / "old.svg")
    groups = [
        {
            "label": "m",
            "panel": "lt",
            "rounds": ROUNDS,
            "runs": {k: A for k in ("many_acc", "medium_acc", "few_acc")},
        }
    ]
    plots.plot_group_curves(groups, tmp_path / "g.png")
    for bad in ("c.jpg", "p.jpg"):
        with pytest.raises(FedfeatError, match=r"\.png, \.pdf or \.svg"):
            if bad == "c.jpg":
                plots.plot_seed_curves(_groups(), tmp_path / bad)
            else:
                plots.plot_partition(counts, ["a", "b"], tmp_path / bad)
        assert not (tmp_path / bad).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "b.pdf",
        "c.pdf",
        "g.png",
        "h.png",
        "old.svg",
        "p.svg",
        "q.png",
    ]
