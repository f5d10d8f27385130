"""Sweeps (``fedfeat sweep``, ``fedfeat.runs.sweep``): grid expansion, one process for many runs whose results equal
the same runs made one by one, skipping finished runs, and the closing mean ± std table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.runs import sweep as sw

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("sw") / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "32", "--train-per-class", "60",
                            "--test-per-class", "20", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_expand_grid_cells_and_params_in_order():
    pts = sw.expand(
        grid={"method": ["fedavg", "fst-cbdg"], "seed": [0, 1]},
        params={"lr": [0.1, 0.2]},
        cells=[{"partition": "shard", "shards": 2}, {"partition": "iid"}],
        fixed={"rounds": 3},
    )
    assert len(pts) == 2 * 2 * 2 * 2
    assert pts[0] == (
        {"rounds": 3, "partition": "shard", "shards": 2, "method": "fedavg", "seed": 0},
        {"lr": 0.1},
    )
    assert pts[1][1] == {"lr": 0.2} and pts[2][0]["seed"] == 1
    assert pts[-1] == ({"rounds": 3, "partition": "iid", "method": "fst-cbdg", "seed": 1}, {"lr": 0.2})


def test_parse_values_and_bad_values():
    assert sw.parse_values("seed", "0-4", int) == [0, 1, 2, 3, 4]
    assert sw.parse_values("alpha", "0.1,0.5", float) == [0.1, 0.5]
    with pytest.raises(FedfeatError, match="--seed 'x': a range|is not a int"):
        sw.parse_values("seed", "1,x", int)
    with pytest.raises(FedfeatError, match="empty value"):
        sw.parse_values("method", "fedavg,,fedntd", str)
    with pytest.raises(FedfeatError, match="the range is empty"):
        sw.parse_values("seed", "4-1", int)


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in ("seconds", "train_seconds"):
            r.pop(k, None)
    return rows


def test_sweep_runs_equal_separate_runs_and_finished_runs_are_skipped(store, tmp_path):
    args = ["--store", str(store), "--method", "fedavg,fst-cbdg", "--seed", "0,1", "--partition", "shard",
            "--clients", "10", "--participation", "0.5", "--rounds", "3", "--set", "lr=0.01,0.02"]  # fmt: skip
    r = runner.invoke(app, ["sweep", *args, "--out", str(tmp_path / "sw")])
    assert r.exit_code == 0, r.output
    runs = sorted(p for p in (tmp_path / "sw").iterdir() if not p.name.startswith("."))
    assert len(runs) == 8
    # the closing table: 4 groups (method x lr) of n = 2 seeds
    assert r.output.count("| 2 | 0,1 |") == 4
    # one of them made alone, in its own invocation, gives the same metrics
    one = runner.invoke(app, ["train", "--store", str(store), "--method", "fst-cbdg", "--seed", "1", "--partition",
                              "shard", "--clients", "10", "--participation", "0.5", "--rounds", "3", "--set",
                              "lr=0.02", "--out", str(tmp_path / "one"), "--quiet"])  # fmt: skip
    assert one.exit_code == 0, one.output
    (alone,) = [p for p in (tmp_path / "one").iterdir() if not p.name.startswith(".")]
    twin = tmp_path / "sw" / alone.name
    assert _rows(twin) == _rows(alone)
    # again: everything finished, nothing redone
    again = runner.invoke(app, ["sweep", *args, "--out", str(tmp_path / "sw")])
    assert again.exit_code == 0 and again.output.count("finished already, skipped") == 8


def test_grid_file_and_a_param_that_one_method_lacks(store, tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(f"""
[fixed]
store = "{store}"
rounds = 2
clients = 10
out = "{tmp_path / "g"}"
[grid]
method = ["fedavg", "zeroshot"]
seed = [0, 1, 2]
[grid.params]
lr = [0.05]
[[cells]]
partition = "iid"
""")
    r = runner.invoke(app, ["sweep", "--grid", str(grid), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert "zeroshot: no hyperparameter lr; those grid keys are skipped for it" in r.output
    groups = json.loads(r.output[r.output.index("[\n") :])
    assert {g["method"]: g["n"] for g in groups} == {"fedavg": 3, "zeroshot": 3}
    zs = next(g for g in groups if g["method"] == "zeroshot")
    assert zs["metrics"]["final_acc"]["std"] == 0.0  # zero-shot does not depend on the seed


def test_bad_grid_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[grid]\nmethod = [\n")
    r = runner.invoke(app, ["sweep", "--grid", str(bad)])
    assert r.exit_code == 2 and "is not valid TOML" in r.output
    bad.write_text("[grids]\nmethod = ['fedavg']\n")
    r = runner.invoke(app, ["sweep", "--grid", str(bad)])
    assert r.exit_code == 2 and "unknown tables ['grids']" in r.output


def test_eval_every_evaluates_round_0_every_nth_and_the_last(store, tmp_path):
    base = ["train", "--store", str(store), "--method", "fedavg", "--clients", "10", "--participation", "0.5",
            "--rounds", "5", "--quiet"]  # fmt: skip
    r = runner.invoke(app, [*base, "--eval-every", "3", "--out", str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    (run,) = [p for p in (tmp_path / "e").iterdir() if not p.name.startswith(".")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows if x["test_acc"] is not None] == [0, 3, 5]
    assert all(x["train_loss"] is not None for x in rows[1:])
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "f")]).exit_code == 0
    (frun,) = [p for p in (tmp_path / "f").iterdir() if not p.name.startswith(".")]
    frows = [json.loads(x) for x in (frun / "metrics.jsonl").read_text().splitlines()]
    assert [x["test_acc"] for x in frows if x["round"] in (0, 3, 5)] == [
        x["test_acc"] for x in rows if x["test_acc"] is not None
    ]
    assert [x["train_loss"] for x in frows] == [x["train_loss"] for x in rows]  # training is unchanged
    s = json.loads((run / "summary.json").read_text())
    assert s["best_acc"] == max(x["test_acc"] for x in rows if x["test_acc"] is not None)
    assert s["best_round"] in (0, 3, 5)
    bad = runner.invoke(app, [*base, "--eval-every", "0", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "--eval-every must be >= 1" in bad.output


def test_crossed_cell_axes_with_cell_params():
    pts = sw.expand(
        grid={"seed": [0, 1]},
        cells={
            "partitions": [{"partition": "iid"}, {"partition": "shard", "shards": 2}],
            "methods": [{"method": "fedavg"}, {"method": "fst-cbdg", "params": {"sampling": False}}],
        },  # fmt: skip
    )
    assert len(pts) == 2 * 2 * 2
    assert pts[2] == ({"partition": "iid", "method": "fst-cbdg", "seed": 0}, {"sampling": False})
    assert pts[-1] == (
        {"partition": "shard", "shards": 2, "method": "fst-cbdg", "seed": 1},
        {"sampling": False},
    )
    demo = sw.expand(**sw.read_grid(Path(__file__).resolve().parents[1] / "configs" / "demo.toml"))
    assert len(demo) == 2 * 6 * 5  # make demo: partitions x methods x seeds


def test_seed_figure_and_partition_views(store, tmp_path):
    args = ["--store", str(store), "--method", "zeroshot,fedavg", "--seed", "0-2", "--clients", "10",
            "--participation", "0.5", "--rounds", "2", "--partition", "shard"]  # fmt: skip
    assert runner.invoke(app, ["sweep", *args, "--out", str(tmp_path / "r"), "--quiet"]).exit_code == 0
    fig = tmp_path / "curves.svg"
    r = runner.invoke(app, ["report", str(tmp_path / "r"), "--seeds", "--plot", str(fig)])
    assert r.exit_code == 0, r.output
    svg = fig.read_text()
    assert "<svg" in svg and "fedavg (n=3)" in svg and "zero-shot" in svg and "zeroshot (n=3)" not in svg
    for view in ("heatmap", "percent", "bars"):
        out = tmp_path / f"p-{view}.pdf"
        r = runner.invoke(app, ["partition", str(store), "--scheme", "shard", "--clients", "10", "--no-save",
                                "--plot", str(out), "--view", view])  # fmt: skip
        assert r.exit_code == 0, r.output
        assert out.read_bytes().startswith(b"%PDF")
    bad = runner.invoke(
        app, ["partition", str(store), "--no-save", "--plot", str(tmp_path / "x.png"), "--view", "pie"]
    )
    assert bad.exit_code == 2 and "unknown --view 'pie'" in bad.output


def test_report_best_selects_per_method_and_says_on_what(store, tmp_path):
    args = ["--store", str(store), "--method", "fedavg", "--seed", "0,1", "--clients", "10", "--participation", "0.5",
            "--rounds", "2", "--partition", "shard", "--set", "lr=0.001,0.5"]  # fmt: skip
    assert runner.invoke(app, ["sweep", *args, "--out", str(tmp_path / "r"), "--quiet"]).exit_code == 0
    full = json.loads(
        runner.invoke(app, ["report", str(tmp_path / "r"), "--seeds", "--format", "json"]).output
    )
    best = max(full, key=lambda g: g["metrics"]["final_acc"]["mean"])
    r = runner.invoke(app, ["report", str(tmp_path / "r"), "--best"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("best settings selected on the TEST split's final accuracy")
    rows = [x for x in r.output.splitlines() if x.startswith("| fedavg")]
    assert len(rows) == 1 and f"| {best['settings']} |" in rows[0]
