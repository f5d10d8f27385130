"""A validation split held out of the test split (``--val-split``): ``val_acc`` per round, test metrics without its
rows, round and setting selection on it (``summary.json``'s ``best_val_*``, ``report --best``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.engine.data import holdout, load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.partition.make import make_partition
from fedfeat.runs.writers import _best_on_val
from fedfeat.store.synth import SynthParams, write_synthetic_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    p = SynthParams(classes=5, dim=16, train_per_class=30, test_per_class=11, templates=1, s=0.6)
    return write_synthetic_store(
        tmp_path_factory.mktemp("val") / "s.zarr", p, stats=False, log=lambda *_: None
    )


def test_holdout_takes_round_f_n_per_class_and_is_seeded():
    y = np.repeat(np.arange(3), [10, 4, 7])
    a, b = holdout(y, 0.2, 0), holdout(y, 0.2, 0)
    assert (a == b).all() and [int(a[y == c].sum()) for c in range(3)] == [2, 1, 1]  # round(2.0, 0.8, 1.4)
    assert (holdout(y, 0.2, 1) != a).any()


def test_val_rows_are_scored_apart_from_the_test_rows(store):
    part = make_partition(store.labels("train"), "iid", clients=4, seed=0)
    data = load_run_data(store, part, val_split=0.3)
    vm = data.val_mask
    assert int(vm.sum()) == 5 * 3 and len(vm) == 55  # round(0.3 * 11) = 3 per class
    assert data.val_mask is not None and len(data.test_y) == 55
    m = get_method("fedavg", {"batch_size": "10"})
    glob, rows = run_federated(m, data, rounds=2, participation=1.0, seed=0)
    x = torch.nn.functional.normalize(data.test_x.float(), dim=-1)
    pred = (m.p.logit_scale * (x @ glob["W"].T + glob["b"])).argmax(1)
    right = (pred == data.test_y).double()
    assert rows[-1]["test_acc"] == pytest.approx(100 * float(right[~vm].mean()), abs=1e-9)
    assert rows[-1]["val_acc"] == pytest.approx(100 * float(right[vm].mean()), abs=1e-9)
    # per-class accuracies count the test rows only (8 per class)
    y = data.test_y[~vm]
    pc = [100 * float(right[~vm][y == c].mean()) for c in range(5)]
    assert rows[-1]["per_class_acc"] == pytest.approx(pc, abs=1e-9)


def test_local_test_splits_lose_their_validation_rows(store):
    part = make_partition(store.labels("train"), "dirichlet-joint", clients=3, alpha=0.5, seed=1,
                          test_labels=store.labels("test"))  # fmt: skip
    full = load_run_data(store, part, local_test="joint")
    held = load_run_data(store, part, local_test="joint", val_split=0.2)
    vm = held.val_mask
    for a, b in zip(full.local_test, held.local_test):
        assert b.tolist() == [r for r in a.tolist() if not vm[r]]


def test_best_val_round_selects_on_validation_first_of_ties():
    ev = [{"round": 0, "test_acc": 50, "val_acc": 40}, {"round": 2, "test_acc": 70, "val_acc": 60},
          {"round": 4, "test_acc": 90, "val_acc": 60}, {"round": 6, "test_acc": 65, "val_acc": 55}]  # fmt: skip
    assert _best_on_val(ev) == {"best_val_acc": 60, "best_val_round": 2, "test_acc_at_best_val": 70}
    assert _best_on_val([{"round": 0, "test_acc": 1.0}]) == {}


def test_bad_val_split_is_one_line(store):
    part = make_partition(store.labels("train"), "iid", clients=4, seed=0)
    with pytest.raises(FedfeatError, match="between 0.05 and 0.5"):
        load_run_data(store, part, val_split=0.01)  # round(0.11) = 0 per class: no validation image


def test_train_and_report_best_select_on_validation(store, tmp_path: Path):
    out = tmp_path / "runs"
    for lr in ("0.01", "0.5"):
        r = CliRunner().invoke(app, ["train", "--store", str(store.path), "--method", "fedavg", "--partition", "iid",
                                     "--clients", "4", "--participation", "1", "--rounds", "3", "--val-split", "0.2",
                                     "--set", f"lr={lr}", "--out", str(out), "--quiet"])  # fmt: skip
        assert r.exit_code == 0, r.output
    sums = [json.loads(p.read_text()) for p in out.glob("*/summary.json")]
    assert len(sums) == 2 and all("val_acc" in s and "test_acc_at_best_val" in s for s in sums)
    for s in sums:
        rows = [json.loads(x) for x in (out / s["name"] / "metrics.jsonl").read_text().splitlines()]
        best = max(rows, key=lambda r: (r["val_acc"], -r["round"]))
        assert (s["best_val_round"], s["test_acc_at_best_val"]) == (best["round"], best["test_acc"])
    r = CliRunner().invoke(app, ["report", str(out), "--best"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("best settings selected on the validation accuracy (val_acc)")
    keep = max(sums, key=lambda s: s["val_acc"])["params"]["lr"]
    assert f"lr={keep}" in r.output or keep == 0.01  # the default lr shows as "-"
    r = CliRunner().invoke(app, ["report", str(out)])
    assert "best acc (selected on test)" in r.output and "test acc @ best val round" in r.output
