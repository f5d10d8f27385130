"""Issue 30, item 1: a sweep's (and ``reproduce``'s) session holds only what its next runs read -- each store,
partition, ``RunData`` and live encoder is dropped after the last run that reads it -- and its runs equal the same
runs made one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.runs import session as S

runner = CliRunner()
ALPHAS = [0.1, 0.3, 0.5, 0.7]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("mem") / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "32", "--train-per-class", "60",
                            "--test-per-class", "20", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture()
def watch(monkeypatch):
    """Records, at every ``Session.done`` (after each run or stack), what the session held before and after it."""
    seen: list[dict] = []
    orig = S.Session.done

    def done(self, cfgs):
        before, before_bytes = self.held(), self.held_bytes()
        memos = sum(1 for st in self.stores.values() if getattr(st, "memo", None))
        n = orig(self, cfgs)
        seen.append({"before": before, "bytes": before_bytes, "after": self.held(), "dropped": n, "memos": memos,
                     "stores": {S.signatures(c)["stores"] for c in cfgs},
                     "runs": len(cfgs), "data_sigs": {S.signatures(c)["data"] for c in cfgs}})  # fmt: skip
        return n

    monkeypatch.setattr(S.Session, "done", done)
    return seen


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in ("seconds", "train_seconds"):
            r.pop(k, None)
    return rows


COMMON = ["--method", "fedavg", "--partition", "dirichlet", "--clients", "5", "--rounds", "2",
          "--participation", "1.0", "--device", "cpu"]  # fmt: skip


def test_sweep_over_four_alphas_holds_one_cell_and_equals_runs_one_by_one(store, tmp_path, watch):
    r = runner.invoke(app, ["sweep", "--store", str(store), *COMMON, "--seed", "0,1",
                            "--alpha", ",".join(map(str, ALPHAS)), "--out", str(tmp_path / "sw")])  # fmt: skip
    assert r.exit_code == 0, r.output
    # 4 cells x 2 seeds, each cell's 2 seeds stacked: 4 stacks, each reading its own partition and RunData
    stacks = [w for w in watch if w["runs"] == 2]
    assert len(stacks) == 4 and all(len(w["data_sigs"]) == 1 for w in stacks)
    assert len({next(iter(w["data_sigs"])) for w in stacks}) == 4
    for k, w in enumerate(stacks):
        # while a stack ran the session held one cell's RunData (the runs' names drew every partition up front:
        # index arrays, each dropped after its cell's last run) ...
        assert w["before"]["data"] == 1 and w["before"]["stores"] == 1
        assert w["before"]["partitions"] == 4 - k and w["after"]["partitions"] == 3 - k
        assert w["bytes"] > 0
        # ... and after it, nothing of that cell (the store too after the last)
        assert w["after"]["data"] == 0 and w["dropped"] >= 2
        assert w["after"]["stores"] == (0 if k == 3 else 1)
    # the cells are the same shape: one cell's bytes, never a sum over cells (a leak would grow 1x, 2x, 3x, 4x)
    sizes = [w["bytes"] for w in stacks]
    assert max(sizes) < 1.5 * min(sizes)
    # every run equals the same run made alone, in its own process-free session
    runs = sorted(p for p in (tmp_path / "sw").iterdir() if not p.name.startswith("."))
    assert len(runs) == 8
    for a in ALPHAS:
        for seed in (0, 1):
            one = runner.invoke(app, ["train", "--store", str(store), *COMMON, "--alpha", str(a), "--seed",
                                      str(seed), "--out", str(tmp_path / "one"), "--quiet"])  # fmt: skip
            assert one.exit_code == 0, one.output
    alone = sorted(p for p in (tmp_path / "one").iterdir() if not p.name.startswith("."))
    assert [p.name for p in alone] == [p.name for p in runs]
    for a, b in zip(alone, runs):
        assert _rows(a) == _rows(b), a.name


def test_interleaved_cells_run_cell_by_cell_with_the_same_results(store, tmp_path, watch):
    """A grid whose outer axis is the method (fedavg, fedprox per alpha): the runs of one cell are made one after
    another, so at most one cell's data is held; the run directories are those of the grid's own order."""
    from fedfeat.runs.sweep import expand, run_sweep

    base = {"store": str(store), "partition": "dirichlet", "clients": 5, "rounds": 2, "participation": 1.0,
            "device": "cpu", "out": str(tmp_path / "g")}  # fmt: skip
    pts = expand(grid={"method": ["fedavg", "fedprox"], "alpha": [0.3, 0.7]}, fixed=base)
    paths = run_sweep(pts, progress=False, log=lambda *a: None, stack=False)
    assert len(watch) == 4 and all(w["before"]["data"] <= 1 for w in watch)
    # the two runs of a cell are adjacent: the cell is dropped after its second run, not before
    assert [w["dropped"] > 0 for w in watch] == [False, True, False, True]
    assert [w["data_sigs"] for w in watch][0] == [w["data_sigs"] for w in watch][1]
    # the returned directories are in the points' order, and each equals its run made alone
    for (settings, params), p in zip(pts, paths):
        assert settings["method"] in p.name
        (alone,) = run_sweep([({**settings, "out": str(tmp_path / "alone")}, params)], progress=False,
                             log=lambda *a: None)  # fmt: skip
        assert alone.name == p.name and _rows(alone) == _rows(p)


def test_reproduce_holds_at_most_the_cells_in_flight(tmp_path, watch, monkeypatch):
    """A 2-column table on a tiny stand-in: two rows per column, interleaved in the table's order; each
    ``run_sweep`` step holds at most one column's RunData, and the table is the same as the runs'."""
    from fedfeat.runs import reproduce as R

    monkeypatch.setattr(R, "SYNTH_SHAPES", {("cifar10", "RN50"): dict(classes=10, train_per_class=60,
                                                                     test_per_class=10, dim=32, templates=2)})  # fmt: skip
    table = R.Table(
        "tiny-mem", "tiny memory table", "RN50", "make cache-fst-cbdg",
        [R.Column("cifar10", "a=0.3", {"partition": "dirichlet", "alpha": 0.3}),
         R.Column("cifar10", "a=1.0", {"partition": "dirichlet", "alpha": 1.0})],
        [R.Row("FedAvg", "fedavg"), R.Row("FedProx", "fedprox")],
        {"FedAvg": [1.0, 2.0], "FedProx": [3.0, 4.0]}, {"clients": 5, "participation": 1.0, "rounds": 1,
                                                        "device": "cpu"},
    )  # fmt: skip
    monkeypatch.setitem(R.TABLES, "tiny-mem", table)
    cells = json.loads(R.reproduce("tiny-mem", store_root=tmp_path / "cache", synthetic=True, seeds=2, fmt="json",
                                   out=tmp_path / "runs", log=lambda *a: None))  # fmt: skip
    assert len(cells) == 4 and {c["n"] for c in cells} == {2}
    # fedavg and fedprox stack per column: 4 stacks of 2; each held one column's RunData, never both
    assert len(watch) == 4 and all(w["runs"] == 2 for w in watch)
    assert max(w["before"]["data"] for w in watch) == 1
    assert [w["after"]["data"] for w in watch] == [1, 0, 1, 0]
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/summary.json")]
    for c in cells:
        a = {"a=0.3": "dirichlet-a0.3-", "a=1.0": "dirichlet-a1-"}[c["column"]]
        acc = [
            r["final_acc"] for r in runs if r["method"] == c["row"].lower() and r["partition"].startswith(a)
        ]
        assert len(acc) == 2 and c["mean"] == pytest.approx(sum(acc) / 2)


def test_grid_over_two_stores_holds_one_stores_splits_at_a_time(store, tmp_path, watch):
    """alpha outer, store inner: the points interleave the stores, the sweep makes one store's cells after the
    other's, and a store's memo of whole splits (read once for all its cells) is emptied after its last cell's
    load: never two stores' splits at once, and none at the end of each store's cells."""
    from fedfeat.runs.sweep import expand, run_sweep

    other = tmp_path / "other.zarr"
    r = runner.invoke(app, ["synth", "--out", str(other), "--dim", "32", "--train-per-class", "40",
                            "--test-per-class", "10", "--templates", "1", "--no-stats", "--seed", "5"])  # fmt: skip
    assert r.exit_code == 0, r.output
    base = {"method": "fedavg", "partition": "dirichlet", "clients": 5, "rounds": 1, "participation": 1.0,
            "device": "cpu", "out": str(tmp_path / "g")}  # fmt: skip
    pts = expand(grid={"alpha": [0.3, 0.7, 1.0], "store": [str(store), str(other)]}, fixed=base)
    with S.session() as sess:
        paths = run_sweep(pts, progress=False, log=lambda *a: None, stack=False)
        assert sess.memos_emptied == 2 and not sess.loads
    assert len(watch) == 6 and all(w["memos"] <= 1 for w in watch)
    order = [next(iter(w["stores"])) for w in watch]
    assert order[:3] == [order[0]] * 3 and order[3:] == [order[3]] * 3 and order[0] != order[3]
    # each store's memo is gone once its last cell has loaded: before the done of its last run
    assert [w["memos"] for w in watch] == [1, 1, 0, 1, 1, 0]
    assert all(p is not None and (p / "summary.json").is_file() for p in paths)
