"""Numbers a researcher can publish (issue 35): `report` counts a run once however many paths name it, marks
diverged runs, names each run and its seed, keeps memory under --seeds; figures keep a method's look in every
figure, keep coinciding curves visible, name every swept setting, draw zero-shot's own group accuracy, take --dpi,
say when --best selected on the test split; each run's curve.png has whole-round ticks and a title in words.

Most run directories here are written by hand (config.toml, summary.json, metrics.jsonl as a run writes them), so
that every expected number is computed by hand in the test."""

from __future__ import annotations

import csv
import io
import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.report import plots, tables

runner = CliRunner()
MISSING = object()


def method_defaults(name: str) -> dict:
    """A method's default hyperparameters, as its params dataclass declares them."""
    import dataclasses

    from fedfeat.methods import REGISTRY

    return dataclasses.asdict(REGISTRY[name].Params())


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def _run(root, name, *, method="fedavg", seed=0, accs=(32.0, 50.0, 70.0), params=None, partition="iid",
         participation=1.0, out="runs", diverged=MISSING, groups=None, **extra):  # fmt: skip
    """A finished run directory as `fedfeat train` writes it: config.toml, summary.json, metrics.jsonl.
    ``groups``: per-round (many, medium, few) accuracies."""
    d = root / name
    d.mkdir(parents=True)
    p = {**method_defaults(method), **(params or {})}
    run = {"method": method, "store": "/data/s.zarr", "partition": partition, "clients": 10,
           "participation": participation, "rounds": len(accs) - 1, "seed": seed, "out": out,
           "store_fingerprint": "f00d"}  # fmt: skip
    lines = ["[run]"] + [f"{k} = {_toml(v)}" for k, v in run.items()] + ["", "[params]"]
    (d / "config.toml").write_text("\n".join(lines + [f"{k} = {_toml(v)}" for k, v in p.items()]) + "\n")
    rows = [
        {"round": i, "test_acc": a, "bytes_up": 0, "bytes_down": 0, "seconds": 0.1}
        for i, a in enumerate(accs)
    ]
    for i, g in enumerate(groups or []):
        rows[i].update(many_acc=g[0], medium_acc=g[1], few_acc=g[2])
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = {"name": name, "method": method, "store": "/data/s.zarr", "store_fingerprint": "f00d",
         "partition": f"{partition}-c10-s19940817", "clients": 10, "participation": participation,
         "rounds": len(accs) - 1, "seed": seed, "initial_acc": accs[0], "final_acc": accs[-1],
         "best_acc": max(accs), "seconds_per_round": 0.1, "bytes_up": 0, "params": p, **extra}  # fmt: skip
    if groups:
        s.update(many_acc=groups[-1][0], medium_acc=groups[-1][1], few_acc=groups[-1][2])
    if diverged is not MISSING:
        s["diverged"] = diverged
    (d / "summary.json").write_text(json.dumps(s))
    return d


def _four_seeds(root):
    """fedavg at its defaults, seeds 0-3, final accuracies 70, 74, 78, 80: mean 75.5, sample std
    sqrt((5.5² + 1.5² + 2.5² + 4.5²) / 3) = sqrt(59 / 3) = 4.43 (the 8 copies of a double count give 4.11)."""
    for seed, acc in zip(range(4), (70.0, 74.0, 78.0, 80.0)):
        _run(root, f"fedavg-s{seed}", seed=seed, accs=(32.0, 50.0, acc))
    return root


def _cli(*args):
    r = runner.invoke(app, ["report", *map(str, args)])
    return r


def _md(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [x for x in text.splitlines() if x.startswith("|")]
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in lines]
    return cells[0], cells[2:]


# ------------------------------------------------------------------------------------------------ counting


def test_a_folder_named_twice_is_counted_once(tmp_path):
    d = _four_seeds(tmp_path / "a")
    once = _cli(d, "--seeds")
    twice = _cli(d, d, "--seeds")
    assert once.exit_code == twice.exit_code == 0, twice.output
    assert twice.stdout == once.stdout
    head, rows = _md(once.stdout)
    assert len(rows) == 1 and rows[0][head.index("n")] == "4" and rows[0][head.index("seeds")] == "0,1,2,3"
    assert rows[0][head.index("final acc")] == "75.50 ± 4.43"
    (line,) = [x for x in twice.stderr.splitlines() if x.startswith("report:")]
    assert line.startswith(
        "report: 4 run directories are duplicates of runs already counted (same settings and seed): "
    )
    assert line.count("(named twice)") == 4
    # a run directory named directly and through its parent: one run
    r = _cli(d, d / "fedavg-s0", "--format", "json")
    assert len(json.loads(r.stdout)) == 4
    # the plain table, JSON and --best count each run once too
    assert len(_md(_cli(d, d).stdout)[1]) == 4
    assert len(json.loads(_cli(d, d, "--format", "json").stdout)) == 4
    best = json.loads(_cli(d, d, "--best", "--format", "json").stdout)
    assert [g["n"] for g in best["groups"]] == [4]


def test_copies_made_by_another_launcher_are_one_run(tmp_path):
    a = _four_seeds(tmp_path / "a")
    b = tmp_path / "b"
    for seed, acc in zip(range(4), (70.0, 74.0, 78.0, 80.0)):  # the same runs, another launcher's folder
        _run(b, f"fedavg-s{seed}", seed=seed, accs=(32.0, 50.0, acc), out="elsewhere", device="cuda")
    _run(b, "fedavg-s4", seed=4, accs=(32.0, 50.0, 90.0))  # and one run only b has
    r = _cli(a, b, "--seeds")
    assert r.exit_code == 0, r.output
    head, rows = _md(r.stdout)
    # five distinct runs: 70, 74, 78, 80, 90 -> mean 78.4, std sqrt((8.4² + 4.4² + 0.4² + 1.6² + 11.6²) / 4) = 7.54
    assert rows[0][head.index("n")] == "5" and rows[0][head.index("seeds")] == "0,1,2,3,4"
    assert rows[0][head.index("final acc")] == "78.40 ± 7.54"
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("report:")]
    assert "4 run directories are duplicates" in line
    assert f"{b / 'fedavg-s0'} (kept the one in {a})" in line and "fedavg-s4" not in line


def test_real_runs_copied_to_another_folder(tmp_path):
    """Run directories written by `train` (their own config.toml), copied whole into a second folder."""
    import fedfeat

    store = _store(tmp_path)
    for seed in (0, 1):
        fedfeat.train(store=store, method="fedavg", partition="iid", clients=4, rounds=1, seed=seed,
                      out=tmp_path / "a")  # fmt: skip
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    one = _cli(tmp_path / "a", "--seeds", "--format", "json")
    two = _cli(tmp_path / "a", tmp_path / "b", "--seeds", "--format", "json")
    assert json.loads(two.stdout) == json.loads(one.stdout)
    assert json.loads(one.stdout)[0]["n"] == 2 and "2 run directories are duplicates" in two.stderr


def test_copies_that_disagree_are_warned_about_and_the_first_kept(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, "x0", seed=0, accs=(32.0, 70.0))
    _run(a, "x1", seed=1, accs=(32.0, 74.0))
    _run(b, "x0", seed=0, accs=(32.0, 70.0))
    _run(b, "x1", seed=1, accs=(32.0, 90.0), device="cuda")  # the "same" run, another result
    r = _cli(a, b, "--seeds")
    head, rows = _md(r.stdout)
    assert rows[0][head.index("n")] == "2" and rows[0][head.index("final acc")] == "72.00 ± 2.83"  # 70, 74
    warns = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert len(warns) == 1
    assert (
        f"{a / 'x1'} and {b / 'x1'} are the same run" in warns[0] and "final_acc 74.00 vs 90.00" in warns[0]
    )
    assert "kept the first" in warns[0]
    assert "1 run directory is a duplicate" in r.stderr  # x0 agrees: merged with the usual line
    r = _cli(b, a, "--seeds")  # the other order keeps b's: 70, 90
    assert _md(r.stdout)[1][0][head.index("final acc")] == "80.00 ± 14.14"


# ------------------------------------------------------------------------------------------------ divergence


def _diverging(root):
    _run(root, "fedavg-s0", seed=0, accs=(32.0, 70.0))  # made before "diverged" existed: healthy
    _run(root, "fedavg-s1", seed=1, accs=(32.0, 74.0), diverged={"round": 3, "reason": "loss is not finite"})
    _run(root, "fedavg-s2", seed=2, accs=(32.0, 78.0), diverged=None)
    return root


def test_diverged_runs_are_marked_in_every_table(tmp_path):
    d = _diverging(tmp_path)
    note = "† diverged: fedavg-s1 at round 3 (loss is not finite)"
    r = _cli(d)
    head, rows = _md(r.stdout)
    assert [x[head.index("final acc")] for x in rows] == ["70.00", "74.00 †", "78.00"]
    assert r.stdout.rstrip().splitlines()[-1] == note
    r = _cli(d, "--seeds")
    head, rows = _md(r.stdout)
    assert rows[0][head.index("final acc")] == "74.00 ± 4.00 †"
    assert r.stdout.rstrip().splitlines()[-1] == note
    # CSV: one parseable table, the reason in a column, numbers unmarked
    got = [x for x in csv.reader(io.StringIO(_cli(d, "--format", "csv").stdout)) if x]
    assert got[0][-2:] == ["diverged", "name"] and all(len(x) == len(got[0]) for x in got)
    assert [x[-2] for x in got[1:]] == ["", "fedavg-s1 at round 3 (loss is not finite)", ""]
    assert [x[got[0].index("final acc")] for x in got[1:]] == ["70.00", "74.00", "78.00"]
    got = [x for x in csv.reader(io.StringIO(_cli(d, "--seeds", "--format", "csv").stdout)) if x]
    assert got[1][got[0].index("diverged")] == "fedavg-s1 at round 3 (loss is not finite)" and len(got) == 2
    # JSON: null for a healthy run (the key missing too), the summary's object for a diverged one
    runs = json.loads(_cli(d, "--format", "json").stdout)
    assert [x["diverged"] for x in runs] == [None, {"round": 3, "reason": "loss is not finite"}, None]
    (g,) = json.loads(_cli(d, "--seeds", "--format", "json").stdout)
    assert g["diverged"] == [{"name": "fedavg-s1", "seed": 1, "round": 3, "reason": "loss is not finite"}]
    # the figure's legend says the group holds a diverged run
    assert _cli(d, "--seeds", "--plot", tmp_path / "f.svg").exit_code == 0
    assert "fedavg (n=3, 1 diverged)" in (tmp_path / "f.svg").read_text()
    healthy = tmp_path / "h"
    _run(healthy, "ok", accs=(32.0, 70.0))
    assert "†" not in _cli(healthy, "--seeds").stdout
    assert json.loads(_cli(healthy, "--seeds", "--format", "json").stdout)[0]["diverged"] == []


def test_a_damaged_diverged_key_skips_the_run(tmp_path):
    _run(tmp_path, "good", accs=(32.0, 70.0))
    _run(tmp_path, "bad", seed=1, accs=(32.0, 70.0), diverged={"round": "three", "reason": "x"})
    r = _cli(tmp_path)
    assert r.exit_code == 0 and len(_md(r.stdout)[1]) == 1
    assert "skipped" in r.stderr and "'diverged'" in r.stderr and "integer round" in r.stderr


# ------------------------------------------------------------------------------------------------ columns


def test_per_run_table_names_each_run_and_its_seed(tmp_path):
    _run(tmp_path, "first", seed=7, accs=(32.0, 70.0))
    _run(tmp_path, "second", seed=3, accs=(32.0, 60.0), params={"lr": 0.1})
    head, rows = _md(_cli(tmp_path).stdout)
    assert head[:4] == ["method", "settings", "partition", "seed"] and head[-1] == "name"
    assert [(x[3], x[-1], x[1]) for x in rows] == [("7", "first", "-"), ("3", "second", "lr=0.1")]


def test_memory_with_seeds_is_the_mean_over_seeds(tmp_path):
    _run(tmp_path, "a", seed=0, peak_rss_bytes=1_000_000_000, rss_bytes_at_end=500_000_000)
    _run(tmp_path, "b", seed=1, peak_rss_bytes=3_000_000_000)  # no RSS at end recorded
    head, rows = _md(_cli(tmp_path, "--seeds", "--memory").stdout)
    # peak: mean 2 GB, sample std sqrt(2) = 1.41; at end: one run's
    assert rows[0][head.index("peak RSS (GB)")] == "2.00 ± 1.41"
    assert rows[0][head.index("RSS at end (GB)")] == "0.50"
    assert "peak RSS (GB)" not in _cli(tmp_path, "--seeds").stdout
    head, rows = _md(_cli(tmp_path, "--best", "--memory").stdout)
    assert rows[0][head.index("peak RSS (GB)")] == "2.00 ± 1.41"
    (g,) = json.loads(_cli(tmp_path, "--seeds", "--format", "json").stdout)
    assert g["metrics"]["peak_rss_bytes"] == {"mean": 2e9, "std": pytest.approx(2**0.5 * 1e9), "n": 2}


# ------------------------------------------------------------------------------------------------ figures


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


def _looks(groups, **kw):
    """{label: (colour, marker, linestyle)} of a drawn figure's first panel."""
    from matplotlib.colors import to_hex

    fig = plots._draw_seed_curves(groups, **kw)
    try:
        return {
            ln.get_label().split(" (n=")[0]: (to_hex(ln.get_color()), ln.get_marker(), ln.get_linestyle())
            for ln in fig.axes[0].get_lines()
            if ln.get_label() != "zero-shot"
        }
    finally:
        _close(fig)


def _g(label, runs=((10.0, 20.0, 30.0),), panel="p", method=None):
    return {
        "label": label,
        "method": method,
        "panel": panel,
        "rounds": [1, 2, 3],
        "runs": [list(r) for r in runs],
    }


def test_a_method_keeps_its_colour_and_marker_in_every_figure():
    one = _looks([_g("fedavg"), _g("fedntd")])
    two = _looks([_g("fst-cbdg"), _g("fedprox mu=0.1", method="fedprox"), _g("fedntd"), _g("fedavg")])
    assert one["fedavg"] == two["fedavg"] and one["fedntd"] == two["fedntd"]
    assert len(set(two.values())) == 4  # all told apart
    # a setting of a method: the method's colour, another marker and a dashed line
    prox = _looks([_g("fedprox", method="fedprox"), _g("fedprox mu=0.1", method="fedprox")])
    assert prox["fedprox"][0] == prox["fedprox mu=0.1"][0] == two["fedprox mu=0.1"][0]
    assert prox["fedprox"][1:] != prox["fedprox mu=0.1"][1:] and prox["fedprox"][2] == "-"
    # the per-client figure gives a method the same look
    fig = plots._draw_clients([{"label": "fedntd", "panel": "", "acc": [[1.0, 2.0]]}])
    try:
        from matplotlib.colors import to_hex

        (ln,) = fig.axes[0].get_lines()
        assert (to_hex(ln.get_color()), ln.get_marker()) == one["fedntd"][:2]
    finally:
        _close(fig)


def test_every_method_has_its_own_look_and_plugins_hash_the_same_everywhere():
    from fedfeat.methods import REGISTRY

    looks = {m: (plots.line_style(m)["color"], plots.line_style(m)["marker"]) for m in plots.STYLE_ORDER}
    assert len(set(looks.values())) == len(looks)  # no two listed methods alike
    builtin = {m for m, cls in REGISTRY.items() if cls.__module__.startswith("fedfeat.")}
    assert builtin <= set(plots.STYLE_ORDER), sorted(
        builtin - set(plots.STYLE_ORDER)
    )  # a new built-in: list it
    for m in set(REGISTRY) - set(
        plots.STYLE_ORDER
    ):  # a method added later: hashed, never a listed one's look
        assert (plots.line_style(m)["color"], plots.line_style(m)["marker"]) not in set(looks.values())
    plugin = plots.line_style("my-own-method")
    assert (plugin["color"], plugin["marker"]) not in set(looks.values())  # hashed after the listed ones
    code = "from fedfeat.report.plots import line_style as s; print(s('my-own-method'), s('fedavg x=1'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(h), "PATH": ""},
        ).stdout  # fmt: skip
        for h in (1, 2)
    }
    assert len(outs) == 1 and str(plugin) in outs.pop()  # not Python's salted hash()


def test_coinciding_curves_stay_visible():
    same = [[float(v) for v in range(30)]]
    groups = [
        dict(_g("fedavg", same), rounds=list(range(30))),
        dict(_g("fedntd", same), rounds=list(range(30))),
    ]
    fig = plots._draw_seed_curves(groups)
    try:
        a, b = [ln for ln in fig.axes[0].get_lines() if ln.get_label() != "zero-shot"]
        np.testing.assert_array_equal(a.get_ydata(), b.get_ydata())
        assert a.get_linewidth() > b.get_linewidth()  # the later one thinner: the earlier's edges show
        assert b.get_zorder() > a.get_zorder()
        assert a.get_marker() != b.get_marker()
        assert a.get_markevery() == (0, 3) and b.get_markevery() == (1, 3)  # markers at other rounds
    finally:
        _close(fig)


def test_every_swept_setting_is_named_on_every_curve():
    def s(method, seed, participation=1.0, partition="p", **params):
        p = {**method_defaults(method), **params}
        return ({"method": method, "seed": seed, "partition": partition, "rounds": 2, "clients": 10,
                 "participation": participation, "store_fingerprint": "f", "params": p}, [])  # fmt: skip

    runs = [s("fedprox", 0), s("fedprox", 1), s("fedprox", 0, mu=0.1), s("fedavg", 0), s("fedavg", 0, partition="q"),
            s("fedntd", 0), s("fedntd", 0, participation=0.5), s("fedntd", 0, participation=0.5, partition="q")]  # fmt: skip
    assert tables.figure_labels(runs) == [
        "fedprox mu=0.01", "fedprox mu=0.01", "fedprox mu=0.1",  # the default named beside the other value
        "fedavg", "fedavg",  # one setting per panel: nothing to name (the panel says the partition)
        "fedntd participation=1.0", "fedntd participation=0.5", "fedntd participation=0.5",
    ]  # fmt: skip


def test_group_rows_draw_zeroshots_own_group_accuracy(tmp_path, monkeypatch):
    """Long-tailed runs: zero-shot's overall 68.2 on the test-accuracy row, its medium-shot 82 on the medium row."""
    _run(tmp_path, "zs", method="zeroshot", accs=(68.2, 68.2), groups=[(60.0, 82.0, 40.0)] * 2)
    _run(tmp_path, "fa", accs=(68.2, 75.0), groups=[(60.0, 82.0, 40.0), (70.0, 80.0, 50.0)])
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, tight=True, dpi=None: figs.append(fig))
    from fedfeat.report.load import collect_runs

    found, _ = collect_runs([tmp_path], lambda m: None)
    tables.seed_figure([(s, m, q) for (s, m), q in found], tmp_path / "f.png")
    (fig,) = figs
    try:
        refs = [
            [ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_label() == "zero-shot"] for ax in fig.axes
        ]
        assert refs == [[68.2], [60.0], [82.0], [40.0]]  # rows: test, many, medium, few
        assert [ax.get_ylabel() for ax in fig.axes][2] == "medium-shot accuracy (%)"
    finally:
        _close(fig)
    # a number given for the overall accuracy is not drawn on the group rows
    fig = plots._draw_seed_curves([_g("fedavg", panel="p") | {"runs": {m: [[1.0, 2.0, 3.0]] for m in (
        "test_acc", "many_acc")}}], reference={"p": 68.2}, metric=["test_acc", "many_acc"])  # fmt: skip
    try:
        assert [sum(ln.get_label() == "zero-shot" for ln in ax.get_lines()) for ax in fig.axes] == [1, 0]
    finally:
        _close(fig)


def _png_dpi(path) -> float:
    data = path.read_bytes()
    i = data.index(b"pHYs")
    ppm, _, unit = struct.unpack(">IIB", data[i + 4 : i + 13])
    assert unit == 1  # pixels per metre
    return ppm * 0.0254


def test_dpi_flag_and_its_print_default(tmp_path):
    d = _four_seeds(tmp_path / "a")
    r = _cli(d, "--seeds", "--plot", tmp_path / "f.png")
    assert r.exit_code == 0, r.output
    assert _png_dpi(tmp_path / "f.png") == pytest.approx(200, abs=0.5)  # the default, for print
    r = _cli(d, "--seeds", "--plot", tmp_path / "g.png", "--dpi", "300")
    assert r.exit_code == 0 and _png_dpi(tmp_path / "g.png") == pytest.approx(300, abs=0.5)
    r = _cli(d, "--plot", tmp_path / "h.png", "--dpi", "20")
    assert r.exit_code == 2 and "--dpi must be a whole number from 50 to 1200" in r.output
    assert not (tmp_path / "h.png").exists()
    assert plots.DPI == 200 and "200" in runner.invoke(app, ["report", "--help"]).output


def test_best_figure_says_it_selected_on_the_test_split(tmp_path):
    d = _four_seeds(tmp_path / "a")
    _run(d, "lr", seed=0, params={"lr": 0.1}, accs=(32.0, 50.0, 60.0))
    r = _cli(d, "--best", "--plot", tmp_path / "b.svg")
    assert r.exit_code == 0, r.output
    svg = (tmp_path / "b.svg").read_text()
    assert "settings selected on the TEST split" in svg.replace("\n", " ")
    r = _cli(d, "--seeds", "--plot", tmp_path / "s.svg")
    assert "selected on" not in (tmp_path / "s.svg").read_text()


def _store(tmp_path):
    out = tmp_path / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "20",
                            "--test-per-class", "10", "--templates", "1", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_each_runs_curve_has_whole_rounds_and_a_title_in_words(tmp_path, monkeypatch):
    import fedfeat

    store = _store(tmp_path)
    seen = []

    def keep(fig, path, tight=True, dpi=None):
        fig.canvas.draw()
        ax = fig.axes[0]
        seen.append((path.name, ax.get_title(), list(ax.get_xticks()), dpi))

    monkeypatch.setattr(plots, "_save", keep)
    fedfeat.train(store=store, method="fedprox", partition="iid", clients=4, rounds=2, seed=3, params={"mu": 0.1},
                  out=tmp_path / "r")  # fmt: skip
    ((name, title, ticks, dpi),) = seen
    assert name == "curve.png" and title == "fedprox mu=0.1 on s.zarr, IID, 4 clients, seed 3"
    assert ticks and all(float(t).is_integer() for t in ticks)  # no round 0.5
    assert dpi == plots.RUN_CURVE_DPI


def test_a_seed_group_with_several_diverged_runs_gets_one_footnote(tmp_path):
    """`make demo`'s fedavg under Dirichlet 0.1: 5 of 5 seeds collapse; one line per group, not one per run."""
    _run(tmp_path, "a", seed=0, accs=(32.0, 10.0), diverged={"round": 2, "reason": "test_acc at chance"})
    _run(tmp_path, "b", seed=1, accs=(32.0, 12.0), diverged={"round": 1, "reason": "test_acc at chance"})
    _run(tmp_path, "c", seed=2, accs=(32.0, 70.0))
    out = _cli(tmp_path, "--seeds").stdout.rstrip().splitlines()
    notes = [x for x in out if x.startswith("†")]
    assert notes == [
        "† diverged: fedavg on iid-c10-s19940817: 2 of 3 seeds (0, 1) at rounds 1-2 (seed 0: test_acc at chance)"
    ]


def test_load_runs_says_where_runs_two_folders_down_are(tmp_path, capsys):
    """`fedfeat.load_runs("runs")` over runs/reproduce-x/<table>/<run>: no run is read from there (a report reads a
    folder's runs, not its grandchildren's), and an empty table is not silent (issue 36)."""
    import fedfeat

    _run(tmp_path / "reproduce-x" / "t1", "a", seed=0)
    _run(tmp_path / "reproduce-x" / "t2", "b", seed=1)
    got = fedfeat.load_runs(tmp_path, as_frame=False)
    err = capsys.readouterr().err
    assert got == []
    assert f"no run directly in {tmp_path}; 2 run(s) are in its subfolders" in err
    assert str(tmp_path / "reproduce-x" / "t1") in err
    assert fedfeat.load_runs(tmp_path / "reproduce-x" / "t1", as_frame=False)[0]["seed"] == 0
