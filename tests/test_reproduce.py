"""``fedfeat reproduce``: a paper table's grid on small synthetic stand-in stores, the paper's layout with mean ± std
over seeds beside the paper's numbers, a missing store named with its make target, and --eval-every."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.runs import reproduce as R

runner = CliRunner()


@pytest.fixture()
def small_shapes(monkeypatch):
    shapes = {
        ("cifar10", "RN50"): dict(classes=10, train_per_class=100, test_per_class=20, dim=32, templates=2),
        ("cifar100", "RN50"): dict(
            classes=100, train_per_class=20, test_per_class=4, dim=32, templates=2, s=0.1
        ),
    }
    monkeypatch.setattr(R, "SYNTH_SHAPES", shapes)


def test_table4_on_stand_in_stores_matches_its_runs(small_shapes, tmp_path):
    text = R.reproduce("fst-cbdg-table4", store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=2,
                       out=tmp_path / "runs", fmt="json", log=lambda *a: None)  # fmt: skip
    cells = json.loads(text)
    assert len(cells) == 2 * 4 and {c["n"] for c in cells} == {2}
    assert cells[0]["paper"] == 68.6 and cells[-1]["paper"] == 43.2
    # every cell = mean and sample std of its two runs' final accuracy, recomputed from the run directories
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/summary.json")]
    assert len(runs) == 16 and all(r["rounds"] == 2 for r in runs)
    for c in cells:
        col = next(x for x in R.TABLES["fst-cbdg-table4"].columns if x.label == c["column"])
        ds = f"synth-{col.dataset}-rn50"
        bal = "equal" if c["row"] == "Equal sampling" else "class"
        acc = [r["final_acc"] for r in runs if ds in r["store"] and r["params"]["balance"] == bal
               and r["partition"].startswith(col.settings["partition"])]  # fmt: skip
        assert len(acc) == 2
        assert c["mean"] == pytest.approx(np.mean(acc)) and c["std"] == pytest.approx(np.std(acc, ddof=1))
    # rendered again (markdown), the finished runs are reused, not redone
    logs = []
    md = R.reproduce("fst-cbdg-table4", store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=2,
                     out=tmp_path / "runs", log=logs.append)  # fmt: skip
    assert sum("finished already, skipped" in m for m in logs) == 16
    assert (
        md.startswith("SYNTHETIC STAND-IN, NOT A REPRODUCTION -- FST-CBDG Table 4")
        and "| Balanced sampling |" in md
        and "(74.0)" in md
    )


def test_missing_store_names_the_make_target(tmp_path):
    with pytest.raises(
        FedfeatError, match=r"no RN50 store of cifar10 under .*`make cache-fst-cbdg`.*--synthetic"
    ):
        R.reproduce("fst-cbdg-table1", store_root=tmp_path, log=lambda *a: None)
    r = runner.invoke(app, ["reproduce", "no-such-table"])
    assert r.exit_code == 2 and "unknown table 'no-such-table'; known: fst-cbdg-table1" in r.output


def test_undrawable_column_is_named_not_fatal(small_shapes, tmp_path, monkeypatch):
    """A Dirichlet column that FedNTD's rule cannot draw (100 clients >= 10 samples at alpha 0.05) shows n/a and
    the partitioner's reason; the other columns run. (The table's own alpha = 0.05 column reads min_size = 1: tests/test_min_size.py.)"""
    t = R.TABLES["fst-cbdg-table2"]
    assert t.columns[6].label == "cifar10 a=0.05 (min size 1)" and t.columns[6].settings["min_size"] == 1
    fedntd = R.Column("cifar10", "cifar10 a=0.05", {"partition": "dirichlet", "alpha": 0.05})  # FedNTD's 10
    small = R.Table(t.name, t.title, t.backbone, t.make_target, [fedntd, t.columns[9]], [t.rows[0]],
                    {"CLIP-ZS": [68.7, 68.7]}, t.fixed)  # fmt: skip
    monkeypatch.setitem(R.TABLES, "fst-cbdg-table2", small)
    monkeypatch.setattr("fedfeat.partition.schemes._MAX_DRAWS", 50)
    md = R.reproduce("fst-cbdg-table2", store_root=tmp_path / "c", synthetic=True, seeds=1, rounds=1,
                     out=tmp_path / "r", log=lambda *a: None)  # fmt: skip
    assert "n/a (68.7)" not in md  # zero-shot does not depend on the partition: it is shown in every column
    assert "n/a in cifar10 a=0.05: dirichlet: no draw in 50 gave all 100 clients >= 10 samples" in md


@pytest.fixture()
def tiny_new_tables(monkeypatch):
    """Fed-MP's Table 1 on Caltech101 alone and FedCoPL's main table on CIFAR-10 alone, tiny stand-in stores."""
    monkeypatch.setattr(R, "SYNTH_SHAPES", {
        ("caltech101", "ViT-L-14-336"): dict(classes=102, train_per_class=12, test_per_class=5, dim=32, templates=1,
                                             s=0.1, eta=0.7),
        ("cifar10", "ViT-B-32"): dict(classes=10, train_per_class=60, test_per_class=20, dim=32, templates=2),
    })  # fmt: skip
    import fedfeat.runs.standin as standin

    monkeypatch.setattr(
        standin, "LIVE_TRAIN", 10
    )  # the live stand-ins' images per class (10 shots for Fed-MP)
    monkeypatch.setattr(standin, "LIVE_TEST", 3)
    for name, keep in (("fed-mp-table1", 0), ("fed-mp-table1-f1", 0), ("fedcopl-table1", 4)):
        t = R.TABLES[name]
        cut = {k: [v[keep]] for k, v in t.paper.items()}
        std = {k: [v[keep]] for k, v in (t.paper_std or {}).items()} or None
        small = R.Table(**{**t.__dict__, "columns": [t.columns[keep]], "paper": cut, "paper_std": std})
        monkeypatch.setitem(R.TABLES, name, small)


def _summaries(out):
    return [json.loads(p.read_text()) for p in out.glob("*/summary.json")]


def test_fedmp_table_open_vocab_metric_and_na_rows(tiny_new_tables, tmp_path):
    """Fed-MP Table 1: the open-vocabulary runs' novel accuracy beside the paper's (fractions shown x100, with its
    ±), datasets as rows; prompt methods n/a on a stand-in (no live encoder), ResNet rows n/a (not in fedfeat);
    the F1 table reads the same runs' novel_f1."""
    kw = dict(store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=1, log=lambda *a: None)
    cells = json.loads(R.reproduce("fed-mp-table1", fmt="json", out=tmp_path / "runs", **kw))
    by = {c["row"]: c for c in cells if c["column"] == "Caltech101"}
    runs = _summaries(tmp_path / "runs")
    assert len(runs) == 10 and {r["method"] for r in runs} == {
        "zeroshot",
        "fedclip",
        "fed-mp",
        "promptfl",
        "fedtpg",
    }
    assert all(r["partition"].startswith("disjoint-classes-shot10-c10") and r["rounds"] == 1 for r in runs)
    # the prompt rows run on the live stand-in (a tiny random CLIP), the others on the feature stand-in
    assert {
        Path(r["store"]).name.startswith("fedfeat-standin-vit") for r in runs if r["method"] == "fedtpg"
    } == {True}
    assert {Path(r["store"]).name.startswith("synth-") for r in runs if r["method"] == "fed-mp"} == {True}
    for row, method in (
        ("Fed-MP", "fed-mp"),
        ("FedCLIP", "fedclip"),
        ("CLIP-ZS (not in the paper)", "zeroshot"),
    ):
        acc = [r["final_acc"] for r in runs if r["method"] == method]
        assert by[row]["n"] == 2 and by[row]["mean"] == pytest.approx(np.mean(acc))
        assert by[row]["metric"] == "final_acc" and by[row]["why"] is None
    assert by["Fed-MP"]["paper"] == 99.36 and by["Fed-MP"]["paper_std"] == 0.1
    for row, method in (("PromptFL", "promptfl"), ("FedTPG", "fedtpg")):
        acc = [r["final_acc"] for r in runs if r["method"] == method]
        assert by[row]["n"] == 2 and by[row]["mean"] == pytest.approx(np.mean(acc)) and by[row]["why"] is None
    fed_mp = next(r for r in runs if r["method"] == "fed-mp")[
        "params"
    ]  # the code's readings, the preset's epsilon
    assert (fed_mp["combine"], fed_mp["weights"], fed_mp["pseudo_label"], fed_mp["uncertainty"]) == (
        "sum", "linear", "prediction", 0.2)  # fmt: skip
    assert "not in fedfeat" in by["FedAvg (NN)"]["why"] and by["FedAvg (NN)"]["paper"] == 50.9
    avg = {c["row"]: c for c in cells if c["column"] == "Avg."}
    assert avg["Fed-MP"]["paper"] == 92.99 and avg["Fed-MP"]["mean"] == pytest.approx(by["Fed-MP"]["mean"])
    # the F1 table: the same runs (reused, not redone), its own metric
    logs = []
    md = R.reproduce("fed-mp-table1-f1", out=tmp_path / "runs", **{**kw, "log": logs.append})
    assert sum("finished already, skipped" in m for m in logs) == 10
    f1 = np.mean([r["novel_f1"] for r in runs if r["method"] == "fed-mp"])
    line = next(x for x in md.splitlines() if x.startswith("| Caltech101 |")).split(" | ")
    assert line[-1].startswith(f"{f1:.2f}") and line[-1].endswith("(98.76 ± 0.20) |")
    head = md.splitlines()
    assert (
        head[0].startswith("SYNTHETIC STAND-IN, NOT A REPRODUCTION -- Fed-MP Table 1")
        and "[summary.json: novel_f1]" in md
    )
    assert head[1] == (
        "setting: backbone ViT-L-14-336; 10 clients, 100 % of them per round; rounds 1 (the paper's: 2); seeds 0..1; partition: "
        "preset caltech101, disjoint classes, 10 shots; metric: novel_f1"
    )
    assert "| dataset | CLIP-ZS (not in the paper) | FedAvg (NN) |" in md and "| Average |" in md
    assert "PromptFL, FedTPG: on live stand-ins (synthetic 32-px images" in md


def test_fedcopl_table_local_accuracy_and_na_rows(tiny_new_tables, tmp_path, monkeypatch):
    """FedCoPL's main table reports local_acc (dirichlet-joint, local test splits); fedcopl / promptfl rows are n/a
    on a stand-in with the reason, rows fedfeat lacks say so; a live row that fails at run time is n/a too."""
    import fedfeat.runs.standin as standin

    monkeypatch.setattr(standin, "LIVE_TRAIN", 30)  # Dirichlet 0.1 over 10 clients needs >= 10 samples each
    kw = dict(store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=1, out=tmp_path / "runs",
              log=lambda *a: None)  # fmt: skip
    cells = json.loads(R.reproduce("fedcopl-table1", fmt="json", **kw))
    by = {c["row"]: c for c in cells if c["column"] == "CIFAR10"}
    runs = _summaries(tmp_path / "runs")
    every = {"zeroshot", "copl-linear", "promptfl", "pfedprompt", "fedopt", "fedcopl"}
    assert {r["method"] for r in runs} == every and len(runs) == 14  # 7 rows x 2 seeds
    assert all(r["partition"].startswith("dirichlet-joint-a0.1-c10") for r in runs)
    # FedCoPL runs its reference code's optimiser (momentum carried from client to client)
    assert {r["params"]["optimizer_state"] for r in runs if r["method"] == "fedcopl"} == {"carried"}
    for row, method in (
        ("CLIP Zero-shot", "zeroshot"),
        ("CoPL + linear head (not in the paper)", "copl-linear"),
    ):
        loc = [r["local_acc"] for r in runs if r["method"] == method]
        assert by[row]["metric"] == "local_acc" and by[row]["mean"] == pytest.approx(np.mean(loc))
    assert by["CLIP Zero-shot"]["paper"] == 86.93
    # every row of the paper runs: the prompt rows on the live stand-in (pixels for FedCoPL's and FedOPT's images)
    for row, method, pseudo in (("PromptFL + FPL", "promptfl", "fpl"), ("pFedPrompt + CPL", "pfedprompt", "cpl"),
                                ("FedOPT + CPL", "fedopt", "cpl"), ("FedCoPL", "fedcopl", "copl")):  # fmt: skip
        loc = [r["local_acc"] for r in runs if r["method"] == method and r["params"]["pseudo"] == pseudo]
        assert by[row]["n"] == 2 and by[row]["why"] is None and by[row]["mean"] == pytest.approx(np.mean(loc))
    assert by["FedCoPL"]["paper"] == 95.38 and by["pFedPrompt + CPL"]["paper"] == 90.26

    # a prompt row that gets past the checks and fails in its run is that cell's n/a, the grid goes on: here its
    # "live" stand-in is the feature stand-in, which has no encoder
    monkeypatch.setattr(standin, "live_standin", lambda root, ds, shape, log: R.find_store(
        root, ds, "ViT-B-32", R.TABLES["fedcopl-table1"], True, log))  # fmt: skip
    shutil.rmtree(tmp_path / "runs")

    def only_missing_methods(t, stores, skip=(), live_stores=None):
        return {
            (r, c): row.why
            for r, row in enumerate(t.rows)
            if row.method is None
            for c in range(len(t.columns))
        }

    monkeypatch.setattr(R, "runnable", only_missing_methods)
    md = R.reproduce("fedcopl-table1", **kw)
    assert "n/a for PromptFL + FPL (all columns): store " in md and "has no encoder to rebuild" in md
    assert "| CLIP Zero-shot |" in md and "[summary.json: local_acc]" in md
    assert not list((tmp_path / "runs").glob("promptfl*"))


def test_new_tables_name_the_encode_command(tmp_path):
    with pytest.raises(FedfeatError, match=r"no ViT-L-14-336 store of caltech101 .*`fedfeat encode --dataset "
                       r"imagefolder --root ~/data/caltech101 --name caltech101 --backbone ViT-L-14-336"):  # fmt: skip
        R.reproduce("fed-mp-table1", store_root=tmp_path, log=lambda *a: None)
    with pytest.raises(FedfeatError, match=r"no ViT-B-32 store of dtd .*`fedfeat encode --dataset listfile --root "
                       r"~/data/dtd --name dtd --backbone ViT-B-32 .*--pixels"):  # fmt: skip
        R.reproduce("fedcopl-table1", store_root=tmp_path, log=lambda *a: None)


def test_prompt_rows_on_an_encoded_store_run_or_say_why(tmp_path):
    """On a store made by `fedfeat encode` (the tiny open_clip model) a prompt row runs (its live encoder loaded
    once, before the runs); fedcopl without pixels is n/a with its reason, and the other cells still run (fedtpg in
    the open-vocabulary setting too)."""
    from helpers_clip import TINY_NAME, make_tiny_clip, run_cli, write_cifar10

    tc = make_tiny_clip(tmp_path / "tinyclip")
    c10 = write_cifar10(tmp_path / "data" / "cifar-10-batches-py", n_train=120, n_test=30)
    r = run_cli(["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", tc.config, "--pretrained",
                 tc.weights, "--out", tmp_path / "cache", "--device", "cpu"])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    joint = {"partition": "dirichlet-joint", "alpha": 0.5, "local_test": "joint"}
    table = R.Table(
        "tiny-prompts", "tiny prompt rows", TINY_NAME, "make cache-tiny",
        [R.Column("cifar10", "joint", joint), R.Column("cifar10", "open", {"partition": "disjoint-classes", "shots": 10})],
        [R.Row("ZS", "zeroshot"),
         R.Row("PromptFL + FPL", "promptfl", {"pseudo": "fpl", "n_ctx": "2", "batch_size": "16", "local_epochs": "1"}),
         R.Row("FedTPG", "fedtpg", {"batch_size": "16"}), R.Row("FedCoPL", "fedcopl")],
        {"ZS": [1.0, 2.0]}, {"clients": 3, "participation": 1.0, "rounds": 1, "device": "cpu"},
    )  # fmt: skip
    R.TABLES["tiny-prompts"] = table
    try:
        logs = []
        cells = json.loads(R.reproduce("tiny-prompts", store_root=tmp_path / "cache", seeds=1, fmt="json",
                                       out=tmp_path / "runs", log=logs.append))  # fmt: skip
    finally:
        del R.TABLES["tiny-prompts"]
    by = {(c["row"], c["column"]): c for c in cells}
    assert (
        by[("ZS", "joint")]["n"] == 1 and by[("ZS", "open")]["n"] == 1 and by[("ZS", "open")]["paper"] == 2.0
    )
    assert by[("PromptFL + FPL", "joint")]["n"] == 1 and by[("FedTPG", "joint")]["n"] == 1
    assert (
        by[("FedTPG", "open")]["n"] == 1 and by[("FedTPG", "open")]["mean"] is not None
    )  # open vocabulary runs
    for col in ("joint", "open"):
        assert "needs pixels" in by[("FedCoPL", col)]["why"]
    runs = _summaries(tmp_path / "runs")
    fpl = [x for x in runs if x["method"] == "promptfl" and x["partition"].startswith("dirichlet-joint")]
    assert len(fpl) == 1 and by[("PromptFL + FPL", "joint")]["mean"] == pytest.approx(fpl[0]["final_acc"])
    assert not [x for x in runs if x["method"] == "fedcopl"]


def test_reproduce_list_names_every_table_with_its_setting():
    from typer.testing import CliRunner

    from fedfeat.cli.app import app

    r = CliRunner().invoke(app, ["reproduce", "--list"])
    assert r.exit_code == 0, r.output
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in r.output.splitlines() if ln.startswith("| ")}
    assert set(R.TABLES) <= set(lines)
    assert "backbone ViT-B-32; 20 clients, 40 % of them per round; rounds 200" in lines["clip2fl-table1"]
    assert "10, 5 clients" in lines["fedcopl-table1"] and "metric: local_acc" in lines["fedcopl-table1"]
    js = CliRunner().invoke(app, ["reproduce", "--list", "--format", "json"])
    import json

    got = {t["name"]: t for t in json.loads(js.output)}
    assert [r["label"] for r in got["fed-mp-table1"]["rows"] if r["method"] is None] == [
        "FedAvg (NN)",
        "FedKA (NN)",
    ]


def test_every_row_of_the_papers_tables_is_a_method_or_says_why():
    """CLIP2FL's 12 rows, FedCoPL's 5 and Fed-MP's 6 are all rows; a row is a registered method unless its reason
    says why not, and every row of the paper carries the paper's numbers."""
    from fedfeat.methods import REGISTRY

    want = {
        "clip2fl-table1": ["FedAvg", "FedAvgM", "FedProx", "FedDF", "FedBE", "CCVR", "FedNova", "Fed-Focal Loss",
                           "Ratio Loss", "FedAvg+tau-norm", "CReFF", "CLIP2FL"],
        "fedcopl-table1": ["CLIP Zero-shot", "PromptFL + FPL", "pFedPrompt + CPL", "FedOPT + CPL", "FedCoPL"],
        "fed-mp-table1": ["FedAvg (NN)", "FedKA (NN)", "PromptFL", "FedTPG", "FedCLIP", "Fed-MP"],
    }  # fmt: skip
    for name, labels in want.items():
        t = R.TABLES[name]
        rows = {r.label: r for r in t.rows}
        assert set(labels) <= set(rows) and set(labels) <= set(t.paper), name
        for r in t.rows:
            assert (r.method in REGISTRY) if r.method else len(r.why) > 20, (name, r.label)
    assert [r.label for r in R.TABLES["fed-mp-table1"].rows if r.method is None] == [
        "FedAvg (NN)",
        "FedKA (NN)",
    ]
