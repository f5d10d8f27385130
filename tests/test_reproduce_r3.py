"""``fedfeat reproduce``'s ablation tables (issue 37): CLIP2FL Table 3 (KL / L_pcl ablation at IF = 100) and Fed-MP
Table 2 (adaptive aggregation / multimodal prototyping ablation, A and Phi_F1) are listed, run on tiny stand-ins
(``--synthetic --seeds 1 --rounds 1``), label their stand-ins in every format and show the paper's numbers."""

from __future__ import annotations

import csv
import dataclasses
import io
import json

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.runs import reproduce as R

runner = CliRunner()
NEW = (
    "clip2fl-table2",
    "clip2fl-table3",
    "fed-mp-table2",
    "fed-mp-table2-f1",
    "fedcopl-aggregation",
    "fedcopl-filtering",
    "fed-mp-table1-precision",
    "fed-mp-table1-recall",
    "fed-mp-table2-precision",
    "fed-mp-table2-recall",
    "fed-mp-table3",
)


@pytest.fixture()
def tiny(monkeypatch):
    """Tiny stand-in shapes (D = 32, a few images per class); CReFF / CLIP2FL's server steps cut to a few (their
    defaults, 100 features x 300 re-training epochs, cost minutes); Fed-MP's table cut to two datasets."""
    sh = dict(train_per_class=12, test_per_class=5, dim=32, templates=1, s=0.1, eta=0.7)
    monkeypatch.setattr(R, "SYNTH_SHAPES", {
        ("cifar10", "ViT-B-32"): dict(classes=10, train_per_class=60, test_per_class=10, dim=32, templates=2),
        ("cifar100", "ViT-B-32"): dict(classes=100, train_per_class=12, test_per_class=2, dim=32, templates=2, s=0.1),
        ("caltech101", "ViT-L-14-336"): dict(classes=102, **sh),
        ("ucf101", "ViT-L-14-336"): dict(classes=101, **sh),
        ("dtd", "ViT-B-32"): dict(classes=47, train_per_class=20, test_per_class=5, dim=32, s=0.15),
        # a long tail 150 .. 5 over 30 classes: Many (> 100) 4, Medium 14, Few (< 20) 12 classes (150 (1/30)^(k/29))
        ("imagenet-lt", "ViT-B-32"): dict(classes=30, train_per_class=150, train_min=5, test_per_class=4, dim=32),
    })  # fmt: skip
    fast = {
        "num_features": "2",
        "crt_epochs": "2",
        "match_steps": "2",
        "local_epochs": "1",
        "grad_repeats": "1",
    }
    for name in ("clip2fl-table2", "clip2fl-table3"):
        t = R.TABLES[name]
        rows = [dataclasses.replace(r, params={**r.params, **fast}) if r.method in ("creff", "clip2fl") else r
                for r in t.rows]  # fmt: skip
        # FedDF's validation split (5,000 rows) would take the whole tiny stand-in (clip2fl-table2: server_data=train)
        rows = [dataclasses.replace(r, params={**r.params, "val_size": "200"}) if r.method == "feddf" else r
                for r in rows]  # fmt: skip
        monkeypatch.setitem(R.TABLES, name, dataclasses.replace(t, rows=rows))
    import fedfeat.runs.standin as standin

    monkeypatch.setattr(standin, "LIVE_TRAIN", 10)  # the live stand-in's images per class (FedCoPL's rows)
    monkeypatch.setattr(standin, "LIVE_TEST", 3)
    for name in ("fedcopl-aggregation", "fedcopl-filtering"):
        t = R.TABLES[name]
        rows = [dataclasses.replace(r, params={**r.params, "local_epochs": "1"}) for r in t.rows]
        cut = {k: v[:1] for k, v in t.paper.items()}
        monkeypatch.setitem(
            R.TABLES, name, dataclasses.replace(t, columns=t.columns[:1], rows=rows, paper=cut)
        )
    for name in ("fed-mp-table2", "fed-mp-table2-f1", "fed-mp-table2-precision", "fed-mp-table2-recall"):
        t = R.TABLES[name]
        cut = {k: v[:2] for k, v in t.paper.items()}
        std = {k: v[:2] for k, v in (t.paper_std or {}).items()}
        monkeypatch.setitem(
            R.TABLES, name, dataclasses.replace(t, columns=t.columns[:2], paper=cut, paper_std=std)
        )


def test_list_names_the_ablation_tables():
    r = runner.invoke(app, ["reproduce", "--list"])
    assert r.exit_code == 0, r.output
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in r.output.splitlines() if ln.startswith("| ")}
    assert set(NEW) <= set(lines)
    assert "backbone ViT-B-32; 20 clients, 40 % of them per round; rounds 200" in lines["clip2fl-table3"]
    assert "long-tailed IF=100" in lines["clip2fl-table3"]
    assert (
        "w/o A. A., w/o M. P." in lines["fed-mp-table2"] and "metric: novel_f1" in lines["fed-mp-table2-f1"]
    )
    got = {
        t["name"]: t
        for t in json.loads(runner.invoke(app, ["reproduce", "--list", "--format", "json"]).output)
    }
    assert [r["label"] for r in got["clip2fl-table3"]["rows"]] == [
        "Baseline (CReFF: no KL, no L_pcl)", "w/o L_pcl (KL only)", "CLIP2FL (KL + L_pcl)"]  # fmt: skip
    assert got["fed-mp-table2"]["columns"] == ["Caltech101", "UCF101", "Food101", "Flower102"]
    assert [r["label"] for r in got["fedcopl-filtering"]["rows"]] == [
        "no filtering, no global assignment (PromptFL + FPL)",
        "global assignment only (no confidence / entropy filtering)",
        "confidence + entropy filtering, no global assignment (not evaluated in the paper)",
        "filtering + global assignment: FedCoPL",
    ]


def test_ablation_rows_are_the_switches():
    t = R.TABLES["clip2fl-table3"]
    assert [(r.method, r.params) for r in t.rows] == [
        ("creff", {}),
        ("clip2fl", {"eta": "0"}),
        ("clip2fl", {}),
    ]
    assert t.paper["w/o L_pcl (KL only)"] == [72.20, 35.88]
    assert {c.settings["imbalance_factor"] for c in t.columns} == {100}
    rows = {r.label: r.params for r in R.TABLES["fed-mp-table2"].rows}
    assert rows["w/o A. A."]["adaptive"] == "false" and rows["w/o M. P."]["prototyping"] == "false"
    assert "adaptive" not in rows["Fed-MP"] and "prototyping" not in rows["Fed-MP"]
    # Fed-MP's column is Table 1's Fed-MP (the same runs' reading, the same numbers)
    t1, t2 = R.TABLES["fed-mp-table1"], R.TABLES["fed-mp-table2"]
    assert t2.paper["Fed-MP"] == t1.paper["Fed-MP"][:4]
    assert [r for r in t1.rows if r.label == "Fed-MP"][0].params == rows["Fed-MP"]
    # FedCoPL: the four aggregation choices, otherwise fedcopl-table1's FedCoPL row, in its setting
    t, main = R.TABLES["fedcopl-aggregation"], R.TABLES["fedcopl-table1"]
    assert [r.params["aggregate"] for r in t.rows] == ["none", "both", "text", "visual"]
    copl = [r for r in main.rows if r.label == "FedCoPL"][0]
    assert all({k: v for k, v in r.params.items() if k != "aggregate"} == copl.params for r in t.rows)
    assert t.paper["visual only: FedCoPL (aggregate=visual)"] == main.paper["FedCoPL"][:4]
    assert [c.settings for c in t.columns] == [c.settings for c in main.columns[:4]] and t.fixed == main.fixed
    # FedCoPL's filtering / assignment ablation: the three switches, the paper's x x x row is its PromptFL + FPL
    t = R.TABLES["fedcopl-filtering"]
    sw = ("confidence_filtering", "entropy_filtering", "global_assignment")
    assert [(r.method, tuple(r.params.get(k, "true") for k in sw)) for r in t.rows] == [
        ("promptfl", ("true", "true", "true")),
        ("fedcopl", ("false", "false", "true")),
        ("fedcopl", ("true", "true", "false")),
        ("fedcopl", ("true", "true", "true")),
    ]
    fpl = [r for r in main.rows if r.label == "PromptFL + FPL"][0]
    assert t.rows[0].params == fpl.params and t.paper[t.rows[0].label] == main.paper["PromptFL + FPL"][:4]
    assert t.rows[-1].params == copl.params and t.paper[t.rows[-1].label] == main.paper["FedCoPL"][:4]
    assert t.paper["global assignment only (no confidence / entropy filtering)"] == [
        46.35,
        69.60,
        51.98,
        65.31,
    ]
    assert t.rows[2].label not in t.paper  # "(not evaluated independently)" in the paper
    assert [c.settings for c in t.columns] == [c.settings for c in main.columns[:4]] and t.fixed == main.fixed


def _run(name, fmt, tmp_path):
    args = ["reproduce", name, "--synthetic", "--seeds", "1", "--rounds", "1", "--store-root", str(tmp_path / "cache"),
            "--out", str(tmp_path / "runs" / name), "--format", fmt]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.mark.parametrize(
    ("name", "papers", "stand_in", "ncells"),
    [("clip2fl-table2", ["(23.85)", "(34.92)", "(19.18)", "(7.10)", "(27.72)", "(24.80)"], "features", 40),
     ("clip2fl-table3", ["(70.55)", "(72.20)", "(73.37)", "(34.67)", "(35.88)", "(37.56)"], "features", 6),
     ("fed-mp-table2", ["(99.36 ± 0.10)", "(98.57 ± 0.29)", "(93.32 ± 1.97)", "(88.18 ± 1.00)"], "features", 6),
     ("fed-mp-table2-f1", ["(98.76 ± 0.20)", "(97.90 ± 0.38)", "(92.38 ± 1.74)", "(87.02 ± 1.27)"], "features", 6),
     ("fed-mp-table2-precision", ["(98.48 ± 0.30)", "(97.00 ± 0.58)", "(88.98 ± 2.19)", "(92.12 ± 2.38)"], "features", 6),
     ("fed-mp-table2-recall", ["(99.08 ± 0.14)", "(98.94 ± 0.20)", "(97.84 ± 0.42)", "(88.18 ± 1.00)"], "features", 6),
     ("fedcopl-aggregation", ["(50.45)", "(47.34)", "(55.31)", "(60.89)"], "live", 4),
     ("fedcopl-filtering", ["(45.79)", "(46.35)", "(60.89)"], "live", 4)],
)  # fmt: skip
def test_runs_synthetic_in_every_format_beside_the_papers_numbers(
    tiny, tmp_path, monkeypatch, name, papers, stand_in, ncells
):
    monkeypatch.chdir(tmp_path)
    md = _run(name, "markdown", tmp_path)
    assert "SYNTHETIC STAND-IN, NOT A REPRODUCTION" in md and "rounds 1 (the paper's:" in md
    assert all(p in md for p in papers), md
    if (
        name == "clip2fl-table3"
    ):  # linear heads on frozen features, not the paper's ResNet-8s: said in the header
        assert "reading: frozen-feature reading of ResNet-8 methods" in md
    text = _run(name, "csv", tmp_path)
    got = [r for r in csv.reader(io.StringIO(text)) if r]
    data = [r for r in got if not r[0].startswith("#")]
    assert text.startswith("# SYNTHETIC STAND-IN, NOT A REPRODUCTION")
    assert data[0][-1] == "source" and {r[-1] for r in data[1:]} == {"synthetic stand-in"}
    assert all(p in text for p in papers)
    assert "n/a" not in "".join(",".join(r) for r in data[1:])  # every cell was measured
    cells = json.loads(_run(name, "json", tmp_path))
    assert len(cells) == ncells
    assert {(c["synthetic"], c["source"], c["stand_in"]) for c in cells} == {
        (True, "synthetic stand-in", stand_in)
    }
    t = R.TABLES[name]
    assert all(c["mean"] is not None and c["store"] for c in cells)
    assert all(
        (c["paper"] is not None) == (c["row"] in t.paper) for c in cells
    )  # fedcopl-filtering's v v x: none
    for c in cells:
        col = [x.label for x in t.columns].index(c["column"])
        if c["row"] in t.paper:
            assert c["paper"] == pytest.approx(t.paper[c["row"]][col] * t.paper_scale)


def test_imagenet_lt_table_reads_one_set_of_runs_four_ways(tiny, tmp_path, monkeypatch):
    """CLIP2FL Table 2: the All / Many / Medium / Few columns are the same runs' final_acc / many_acc / medium_acc /
    few_acc (one run per row and seed, not four), grouped by the paper's thresholds (> 100, 20-100, < 20 training
    images: its "Results on ImageNet-LT" paragraph) over a long-tailed stand-in."""
    import numpy as np

    from fedfeat.store.featurestore import FeatureStore

    t = R.TABLES["clip2fl-table2"]
    assert [(c.label, c.metric) for c in t.columns] == [
        ("All", "final_acc"), ("Many", "many_acc"), ("Medium", "medium_acc"), ("Few", "few_acc")]  # fmt: skip
    assert t.fixed["shot_thresholds"] == "100,20" and {c.settings["alpha"] for c in t.columns} == {0.1}
    assert "imbalance_factor" not in t.columns[0].settings  # ImageNet-LT is long-tailed as published
    assert [
        r.label for r in t.rows if r.method is None
    ] == []  # every row runs (no FedBE / FedNova in Table 2)
    monkeypatch.chdir(tmp_path)
    cells = json.loads(_run("clip2fl-table2", "json", tmp_path))
    st = FeatureStore.open(tmp_path / "cache" / "synth-imagenet-lt-vit-b-32.zarr")
    counts = np.bincount(st.labels("train"), minlength=30)
    assert counts[0] == 150 and counts[-1] == 5 and list(counts) == sorted(counts, reverse=True)
    assert ((counts > 100).sum(), ((counts >= 20) & (counts <= 100)).sum(), (counts < 20).sum()) == (
        4,
        14,
        12,
    )
    runs = sorted((tmp_path / "runs" / "clip2fl-table2").glob("*/summary.json"))
    assert len(runs) == len(t.rows)  # one run per row (1 seed), read by the four columns
    by = {(c["row"], c["column"]): c for c in cells}
    for row in t.rows:
        assert {c["metric"] for (r, _), c in by.items() if r == row.label} == {
            "final_acc", "many_acc", "medium_acc", "few_acc"}  # fmt: skip
        assert len({by[(row.label, col.label)]["store"] for col in t.columns}) == 1
    fedavg = [json.loads(p.read_text()) for p in runs]
    fedavg = [s for s in fedavg if s["method"] == "fedavg"][0]
    for col, key in (
        ("All", "final_acc"),
        ("Many", "many_acc"),
        ("Medium", "medium_acc"),
        ("Few", "few_acc"),
    ):
        assert by[("FedAvg", col)]["mean"] == pytest.approx(fedavg[key])
    # the groups are the test images of each group's classes: All is their test-size-weighted mean (4 per class)
    w = np.array([4, 14, 12]) / 30
    parts = [fedavg["many_acc"], fedavg["medium_acc"], fedavg["few_acc"]]
    assert fedavg["final_acc"] == pytest.approx(float(np.dot(w, parts)), abs=1e-9)


def test_fed_mp_table1_precision_recall_read_the_table1_runs(tiny, tmp_path, monkeypatch):
    """Fed-MP Table 1's Phi_P / Phi_R rows: the novel-class macro precision / recall of fed-mp-table1's runs (one
    folder, runs shared), the paper's values not transcribed (a note names where Fed-MP's are: Table 2)."""
    for name in ("fed-mp-table1-precision", "fed-mp-table1-recall"):
        t = R.TABLES[name]
        rows = [r for r in t.rows if r.method in ("fed-mp", "fedclip")]
        monkeypatch.setitem(R.TABLES, name, dataclasses.replace(t, columns=t.columns[:1], rows=rows))
        assert t.runs == "fed-mp-table1" and t.paper == {} and "not transcribed" in t.notes[0]
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "t1"
    got = {}
    for name, key in (
        ("fed-mp-table1-precision", "novel_precision"),
        ("fed-mp-table1-recall", "novel_recall"),
    ):
        r = runner.invoke(app, ["reproduce", name, "--synthetic", "--seeds", "1", "--rounds", "1", "--store-root",
                                str(tmp_path / "cache"), "--out", str(out), "--format", "json"])  # fmt: skip
        assert r.exit_code == 0, r.output
        got[key] = {c["row"]: c for c in json.loads(r.stdout)}
    runs = {
        json.loads(p.read_text())["method"]: json.loads(p.read_text()) for p in out.glob("*/summary.json")
    }
    assert set(runs) == {"fed-mp", "fedclip"}  # the second table reused the first's runs
    for key, cells in got.items():
        assert cells["Fed-MP"]["metric"] == key and cells["Fed-MP"]["paper"] is None
        assert cells["Fed-MP"]["mean"] == pytest.approx(runs["fed-mp"][key])
        assert cells["FedCLIP"]["mean"] == pytest.approx(runs["fedclip"][key])
