"""Figures that go into a paper as they are (issue 27): TrueType fonts in PDFs, readable panel titles, one legend,
print sizes, --metric / --kind, the store's zero-shot line, the per-client figure, and `report --best` with
--plot / --format json."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.partition.core import partition_key
from fedfeat.report import plots, tables

runner = CliRunner()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A tiny sweep: fedavg at two learning rates (lr=0.01 is the default) x 2 seeds, no zeroshot runs."""
    tmp = tmp_path_factory.mktemp("fig")
    store = tmp / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(store), "--dim", "16", "--train-per-class", "30",
                            "--test-per-class", "10", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    args = ["--store", str(store), "--method", "fedavg", "--seed", "0,1", "--clients", "5", "--participation",
            "1", "--rounds", "2", "--partition", "dirichlet", "--alpha", "0.5", "--set", "lr=0.01,0.1"]  # fmt: skip
    r = runner.invoke(app, ["sweep", *args, "--out", str(tmp / "r"), "--quiet"])
    assert r.exit_code == 0, r.output
    return store, tmp / "r"


def _fonts_ok(pdf: bytes) -> None:
    assert b"/Type3" not in pdf  # no Type 3 font anywhere
    assert b"/FontFile2" in pdf  # an embedded TrueType font program (Type 42)


def _pdffonts(path) -> None:
    if shutil.which("pdffonts"):
        out = subprocess.run(["pdffonts", str(path)], capture_output=True, text=True, check=True).stdout
        assert "Type 3" not in out and "TrueType" in out, out


# ------------------------------------------------------------------------------------------------ readable labels


@pytest.mark.parametrize(
    "params, words",
    [
        ({"scheme": "dirichlet", "alpha": 0.1, "clients": 100, "seed": 19940817}, "Dir(α = 0.1), 100 clients"),
        ({"scheme": "shard", "shards": 2, "clients": 100, "seed": 19940817}, "2 shards per client, 100 clients"),
        ({"scheme": "shard", "shards": 1, "clients": 10, "seed": 19940817}, "1 shard per client, 10 clients"),
        ({"scheme": "iid", "clients": 100, "seed": 19940817}, "IID, 100 clients"),
        ({"scheme": "iid", "clients": 100, "seed": 3}, "IID, 100 clients, seed 3"),  # not the default seed
        ({"scheme": "dirichlet-equal", "alpha": 0.5, "clients": 20, "imbalance_factor": 100, "seed": 7},
         "LT IF=100, Dir(α = 0.5), equal sizes, 20 clients"),
        ({"scheme": "dirichlet", "alpha": 1.0, "clients": 10, "imbalance_factor": 50, "seed": 7},
         "LT IF=50, Dir(α = 1), 10 clients"),
        ({"scheme": "disjoint-classes", "shots": 10, "clients": 10, "seed": 0},
         "disjoint classes, 10 shots, 10 clients"),
        ({"scheme": "dirichlet-joint", "alpha": 0.3, "clients": 10, "seed": 2},
         "Dir(α = 0.3) on train and test, 10 clients"),
    ],
)  # fmt: skip
def test_readable_partition_every_scheme(params, words):
    assert plots.readable_partition(partition_key(params)) == words


def test_readable_partition_fallbacks():
    assert plots.readable_partition("iid-c100") == "IID, 100 clients"  # no seed in the key
    assert plots.readable_partition("my-split") == "my-split"  # unknown format: unchanged
    assert plots.readable_partition("newscheme-a2-c4-s1") == "newscheme, α = 2, 4 clients, seed 1"


# ------------------------------------------------------------------------------------------------ curves figure


def _groups():
    return [
        {"label": "fedavg", "panel": "dirichlet-a0.1-c100-s19940817", "rounds": [0, 1, 2],
         "runs": [[10.0, 20.0, 30.0], [12.0, 22.0, 32.0]]},
        {"label": "fedprox mu=0.1", "panel": "dirichlet-a0.1-c100-s19940817", "rounds": [0, 1, 2],
         "runs": [[11.0, 21.0, 31.0]]},
        {"label": "fedavg", "panel": "shard-sh2-c100-s19940817", "rounds": [0, 1, 2],
         "runs": [[5.0, 6.0, 7.0]]},
    ]  # fmt: skip


def test_pdf_embeds_truetype_never_type3(tmp_path):
    pdf = tmp_path / "f.pdf"
    plots.plot_seed_curves(_groups(), pdf, reference=50.0, size="one-column")
    _fonts_ok(pdf.read_bytes())
    _pdffonts(pdf)
    part = tmp_path / "p.pdf"
    plots.plot_partition(np.arange(12).reshape(4, 3), ["a", "b", "c"], part, view="bars")
    _fonts_ok(part.read_bytes())


def test_one_legend_readable_titles_and_print_sizes(tmp_path):
    import matplotlib.pyplot as plt

    for size, width in (("one-column", 3.3), ("two-column", 7.0)):
        with plt.rc_context(plots._print_rc(size)):
            named = [dict(g, panel=plots._panel_title("partition", g["panel"])) for g in _groups()]
            fig = plots._draw_seed_curves(named, reference=40.0, size=size)
        try:
            assert fig.get_size_inches()[0] == pytest.approx(width)
            titles = [ax.get_title().replace("\n", " ") for ax in fig.axes]  # wrapped to a narrow panel
            assert titles == ["Dir(α = 0.1), 100 clients", "2 shards per client, 100 clients"]
            assert all(ax.get_legend() is None for ax in fig.axes)  # no legend in a panel
            assert len(fig.legends) == 1
            texts = [t.get_text() for t in fig.legends[0].get_texts()]
            assert texts == ["fedavg (n=1–2)", "fedprox mu=0.1 (n=1)", "zero-shot"]  # each label once
            assert min(t.get_fontsize() for t in fig.legends[0].get_texts()) >= 8
            mean = fig.axes[0].get_lines()[0].get_ydata()
            np.testing.assert_allclose(mean, [11.0, 21.0, 31.0])
        finally:
            plt.close(fig)
    with pytest.raises(Exception, match="one-column or two-column"):
        plots._print_rc("a4")


# ------------------------------------------------------------------------------------------------ per-client figure


def test_clients_figure_sorted_mean_and_worst_decile(tmp_path):
    import matplotlib.pyplot as plt

    # NaN: a client without local test rows
    a = np.array([50.0, np.nan, 90.0, 70.0, 10.0, 30.0, 60.0, 80.0, 20.0, 40.0, 100.0])
    b = a[[2, 0, 1, 3, 4, 5, 6, 7, 8, 9, 10]] + 2.0  # another seed, another order
    fig = plots._draw_clients([{"label": "fedavg", "panel": "IID, 10 clients", "acc": [a, b]}])
    try:
        line = fig.axes[0].get_lines()[0]
        expect = np.array([100, 90, 80, 70, 60, 50, 40, 30, 20, 10], float) + 1.0  # rank-wise mean of both
        np.testing.assert_allclose(line.get_ydata(), expect)
        np.testing.assert_allclose(line.get_xdata(), np.linspace(0, 1, 10))
        # worst 10 % of 10 clients = the single worst: (10 + 12) / 2 = 11
        assert "worst 10%: 11.0" in line.get_label() and "(n=2;" in line.get_label()
    finally:
        plt.close(fig)
    pdf = tmp_path / "c.pdf"
    plots.plot_clients([{"label": "x", "panel": "iid-c10-s19940817", "acc": [a]}], pdf, size="two-column")
    _fonts_ok(pdf.read_bytes())


# ------------------------------------------------------------------------------------------------ CLI


def test_best_plot_writes_file_and_best_json_is_valid(swept, tmp_path):
    _, runs = swept
    fig = tmp_path / "best.pdf"
    r = runner.invoke(app, ["report", str(runs), "--best", "--plot", str(fig)])
    assert r.exit_code == 0, r.output
    assert fig.read_bytes().startswith(b"%PDF")  # the path printed is a file written
    _fonts_ok(fig.read_bytes())
    r = runner.invoke(app, ["report", str(runs), "--best", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # the whole stdout is one JSON document
    assert doc["selected_on"] == "final_acc" and "TEST split" in doc["selection"]
    assert len(doc["groups"]) == 1 and doc["groups"][0]["n"] == 2  # one of the two lr settings, its 2 seeds
    # --format json with --plot: stdout still valid JSON (the "plot:" line goes to stderr), the file written
    fig2 = tmp_path / "all.png"
    r = runner.invoke(app, ["report", str(runs), "--format", "json", "--plot", str(fig2)])
    assert r.exit_code == 0 and fig2.read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(r.stdout)) == 4


def test_figure_legend_names_swept_defaults_and_zeroshot_from_store(swept, tmp_path, monkeypatch):
    store, runs = swept
    seen = {}

    def capture(groups, path, **kw):
        seen.update(groups=groups, **kw)

    monkeypatch.setattr(plots, "plot_seed_curves", capture)
    from fedfeat.report.load import collect_runs

    found, _ = collect_runs([runs], lambda m: None)
    tables.seed_figure([(s, m, q) for (s, m), q in found], tmp_path / "x.pdf", size="one-column")
    # every swept setting named on every curve, its default value too (issue 35)
    assert sorted(g["label"] for g in seen["groups"]) == ["fedavg lr=0.01", "fedavg lr=0.1"]
    assert seen["size"] == "one-column"
    # the zero-shot line, with no zeroshot run in the set: the store's own, equal to a zeroshot run's accuracy
    (part,) = seen["reference"]
    r = runner.invoke(app, ["train", "--store", str(store), "--method", "zeroshot", "--out", str(tmp_path / "z"),
                            "--name", "zs", "--partition", "dirichlet", "--alpha", "0.5", "--clients", "5"])  # fmt: skip
    assert r.exit_code == 0, r.output
    zs = json.loads((tmp_path / "z" / "zs" / "summary.json").read_text())["final_acc"]
    assert seen["reference"][part] == {"test_acc": pytest.approx(zs, abs=1e-6)}
    assert tables.store_zeroshot(tmp_path / "missing.zarr") is None  # unreadable store: no line, no error


def test_metric_kind_size_flags(swept, tmp_path):
    _, runs = swept
    fig = tmp_path / "loss.svg"
    r = runner.invoke(app, ["report", str(runs), "--seeds", "--plot", str(fig), "--metric", "train_loss",
                            "--size", "two-column"])  # fmt: skip
    assert r.exit_code == 0, r.output
    svg = fig.read_text()
    assert "train_loss" in svg and "zero-shot" not in svg  # the zero-shot level is an accuracy
    assert re.search(r'width="504(\.0+)?pt"', svg)  # exactly 7 in = 504 pt
    bad = runner.invoke(
        app, ["report", str(runs), "--plot", str(tmp_path / "b.pdf"), "--metric", "final_acc"]
    )
    assert bad.exit_code == 2 and "last / best point of test_acc" in bad.output and "test_acc" in bad.output
    assert not (tmp_path / "b.pdf").exists()
    bad = runner.invoke(app, ["report", str(runs), "--plot", str(tmp_path / "b.pdf"), "--size", "a4"])
    assert bad.exit_code == 2 and "one-column or two-column" in bad.output
    bad = runner.invoke(app, ["report", str(runs), "--plot", str(tmp_path / "b.pdf"), "--kind", "clients"])
    assert bad.exit_code == 2 and "--local-test" in bad.output  # these runs have no per-client results


def test_partition_figure_titles_a_key_in_words(tmp_path, monkeypatch):
    titles = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, tight=True: titles.append(fig.axes[0].get_title()))
    counts = np.array([[3, 0], [1, 2], [0, 4]])
    plots.plot_partition(counts, ["a", "b"], tmp_path / "p.pdf", view="bars", title="shard-sh2-c3-s19940817")
    plots.plot_partition(counts, ["a", "b"], tmp_path / "p.pdf", view="heatmap", title="my own title")
    assert titles == ["2 shards per client, 3 clients", "my own title"]
