"""``fedfeat reproduce --format json / csv``: every number of ours carries its source (a synthetic stand-in is
labelled as one in every cell and row), and the CSV is valid CSV whose prose is '#' comment lines (issue 35)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.runs import reproduce as R

runner = CliRunner()


def _small_table():
    """2 columns (one label with a comma, which CSV must quote), a method row, a prompt row (live stand-in under
    --synthetic) and a row fedfeat does not have."""
    cols = [R.Column("cifar10", "cifar10 iid", {"partition": "iid"}),
            R.Column("cifar100", "cifar100, a=0.1", {"partition": "dirichlet", "alpha": 0.1})]  # fmt: skip
    rows = [
        R.Row("FedAvg", "fedavg"),
        R.Row("PromptFL", "promptfl"),
        R.Row("FedKA (NN)", None, why="a ResNet"),
    ]
    paper = {"FedAvg": [74.0, 60.5], "PromptFL": [80.0, None], "FedKA (NN)": [70.0, 55.0]}
    table = R.Table("t", "Paper Table 1", "RN50", "make cache", cols, rows, paper, {"rounds": 10})
    summaries = [{"final_acc": 70.0, "store": "/s/c10.zarr"}, {"final_acc": 72.0, "store": "/s/c10.zarr"},
                 {"final_acc": 50.0, "store": "/s/c100.zarr"}, {"final_acc": 30.0, "store": "/s/live-c10.zarr"},
                 {"final_acc": 20.0, "store": "/s/live-c100.zarr"}]  # fmt: skip
    where = {(0, 0): [0, 1], (0, 1): [2], (1, 0): [3], (1, 1): [4], (2, 0): [], (2, 1): []}
    blocked = {(2, 0): "a ResNet", (2, 1): "a ResNet"}
    return table, summaries, where, blocked


def _csv_rows(text: str) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows, comment lines): every row read by csv.reader; '#' rows are comments."""
    got = [r for r in csv.reader(io.StringIO(text)) if r]
    comments = [",".join(r) for r in got if r[0].startswith("#")]
    data = [r for r in got if not r[0].startswith("#")]
    return data[0], data[1:], comments


@pytest.mark.parametrize("synthetic", [True, False])
def test_json_cells_carry_their_source(synthetic):
    table, summaries, where, blocked = _small_table()
    note = "PromptFL: on live stand-ins" if synthetic else ""
    cells = json.loads(R.render(table, summaries, where, synthetic, "json", blocked=blocked, live_note=note))
    by = {(c["row"], c["column"]): c for c in cells}
    c = by[("FedAvg", "cifar10 iid")]
    assert c["mean"] == pytest.approx(71.0) and c["std"] == pytest.approx(2**0.5) and c["n"] == 2
    assert c["paper"] == 74.0 and c["store"] == "/s/c10.zarr"
    assert by[("FedAvg", "cifar100, a=0.1")]["store"] == "/s/c100.zarr"
    assert by[("FedKA (NN)", "cifar10 iid")]["store"] is None and by[("FedKA (NN)", "cifar10 iid")]["why"]
    assert len(cells) == 6
    for c in cells:  # every cell, n/a ones included, says where ours comes from
        assert c["synthetic"] is synthetic
        assert c["source"] == ("synthetic stand-in" if synthetic else "encoded store")
    if synthetic:
        assert by[("FedAvg", "cifar10 iid")]["stand_in"] == "features"
        assert by[("PromptFL", "cifar10 iid")]["stand_in"] == "live"
    else:
        assert {c["stand_in"] for c in cells} == {None}


@pytest.mark.parametrize("synthetic", [True, False])
def test_csv_is_valid_csv_with_comment_prose_and_a_source_column(synthetic):
    table, summaries, where, blocked = _small_table()
    text = R.render(table, summaries, where, synthetic, "csv", blocked=blocked)
    header, rows, comments = _csv_rows(text)
    assert header == ["method", "cifar10 iid", "cifar100, a=0.1", "source"]
    assert [r[0] for r in rows] == ["FedAvg", "PromptFL", "FedKA (NN)"]
    assert all(len(r) == len(header) for r in rows)
    assert {r[-1] for r in rows} == {"synthetic stand-in" if synthetic else "encoded store"}
    assert rows[0][1] == "71.00 ± 1.41 (74.0)" and rows[2][1] == "n/a (70.0)"
    # the prose: only as comment lines, the title first; the n/a reason among them
    assert comments[0].startswith(
        "# SYNTHETIC STAND-IN, NOT A REPRODUCTION" if synthetic else "# Paper Table 1"
    )
    assert any("n/a for FedKA (NN) (all columns): a ResNet" in c for c in comments)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert all(ln.startswith("#") for ln in lines[: len(lines) - len(rows) - 1 - 1])  # before the header
    assert '"' not in "".join(ln for ln in lines if ln.startswith("#"))  # no quote opens a field in a comment


def test_reproduce_synthetic_json_and_csv_from_the_command_line(tmp_path, monkeypatch):
    """The whole path (stand-in stores, runs, render) through `fedfeat reproduce`: JSON cells name their stand-in
    store; the CSV parses."""
    monkeypatch.setattr(R, "SYNTH_SHAPES", {
        ("cifar10", "RN50"): dict(classes=10, train_per_class=100, test_per_class=20, dim=32, templates=2),
        ("cifar100", "RN50"): dict(classes=100, train_per_class=20, test_per_class=4, dim=32, templates=2, s=0.1),
    })  # fmt: skip
    args = ["reproduce", "fst-cbdg-table4", "--synthetic", "--store-root", str(tmp_path / "cache"), "--seeds",
            "1", "--rounds", "1", "--out", str(tmp_path / "runs"), "--quiet"]  # fmt: skip
    r = runner.invoke(app, [*args, "--format", "json"])
    assert r.exit_code == 0, r.output
    cells = json.loads(r.stdout)
    assert len(cells) == 8 and all(
        c["synthetic"] is True and c["source"] == "synthetic stand-in" for c in cells
    )
    assert all(c["stand_in"] == "features" and "synth-" in c["store"] for c in cells)
    r = runner.invoke(app, [*args, "--format", "csv"])  # the runs are reused
    assert r.exit_code == 0, r.output
    header, rows, comments = _csv_rows(r.stdout)
    assert header[0] == "method" and header[-1] == "source" and len(header) == 6 and len(rows) == 2
    assert all(len(x) == len(header) and x[-1] == "synthetic stand-in" for x in rows)
    assert comments[0].startswith("# SYNTHETIC STAND-IN, NOT A REPRODUCTION -- FST-CBDG Table 4")
