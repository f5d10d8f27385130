"""Per-client and per-class results of a run: ``RUN/results.npz`` (rounds, class_acc, client_acc, confusion),
``fedfeat.report.load.load_results``, report's worst-10% client column, resume and stacked runs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.report.load import load_results

runner = CliRunner()
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("res") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "40", "--test-per-class", "15",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(*args):
    r = runner.invoke(app, ["train", *map(str, args), "--quiet"])
    assert r.exit_code == 0, r.output


def test_results_npz_holds_per_class_per_client_and_confusion(store, tmp_path):
    from safetensors.torch import load_file

    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import local_test_split, make_partition
    from fedfeat.store.featurestore import FeatureStore

    _train("--store", store, "--method", "fedavg", "--clients", "5", "--partition", "dirichlet", "--alpha", "0.3",
           "--rounds", "3", "--participation", "0.6", "--local-test", "proportional", "--out", tmp_path,
           "--name", "x", "--kernel", "torch")  # fmt: skip
    run = tmp_path / "x"
    res = load_results(run)
    assert set(res) == {"rounds", "class_acc", "client_acc", "confusion"}
    rows = _rows(run)
    assert res["rounds"].tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(res["class_acc"], np.array([r["per_class_acc"] for r in rows]))
    assert res["client_acc"].shape == (4, 5) and res["confusion"].dtype == np.int64
    for r, ca in zip(rows, res["client_acc"]):  # local_acc is the mean over clients with local test rows
        assert np.nanmean(ca) == pytest.approx(r["local_acc"], abs=1e-12)
    # the confusion and the per-client vector recomputed by hand from the saved head
    st = FeatureStore.open(store)
    part = make_partition(st.labels("train"), "dirichlet", clients=5, alpha=0.3)
    data = load_run_data(st, part)
    w = load_file(run / "weights.safetensors")
    pred = (data.test_x.float() @ w["W"].T + w["b"]).argmax(1).numpy()
    y = data.test_y.numpy()
    K = st.n_classes
    want = np.zeros((K, K), np.int64)
    np.add.at(want, (y, pred), 1)
    np.testing.assert_array_equal(res["confusion"], want)
    np.testing.assert_allclose(np.diag(want) / want.sum(1) * 100, res["class_acc"][-1], atol=1e-9)
    lt = local_test_split(part, st.labels("train"), y, K, seed=0)
    per = [(pred[r] == y[r]).mean() * 100 if len(r) else np.nan for r in lt]
    np.testing.assert_allclose(res["client_acc"][-1], per, atol=1e-9)
    # report: the worst-10% client accuracy (5 clients: the worst one)
    rep = runner.invoke(app, ["report", str(tmp_path), "--format", "csv"])
    assert rep.exit_code == 0, rep.output
    head, line = rep.output.strip().splitlines()[:2]
    col = head.split(",").index("worst-10% client acc")
    assert float(line.split(",")[col]) == pytest.approx(np.nanmin(per), abs=5e-3)
    assert load_results(tmp_path / "nothing") == {}


def test_no_local_test_no_client_acc_and_damaged_file_is_one_line(store, tmp_path):
    from fedfeat.errors import FedfeatError

    _train("--store", store, "--method", "fedprox", "--clients", "4", "--rounds", "4", "--eval-every", "3",
           "--out", tmp_path, "--name", "y", "--kernel", "torch")  # fmt: skip
    res = load_results(tmp_path / "y")
    assert set(res) == {"rounds", "class_acc", "confusion"}
    assert res["rounds"].tolist() == [0, 3, 4]  # the evaluated rounds only
    assert res["confusion"].sum() == 10 * 15
    (tmp_path / "y" / "results.npz").write_bytes(b"not a zip")
    with pytest.raises(FedfeatError, match="cannot read .*results.npz"):
        load_results(tmp_path / "y")


def test_resumed_run_writes_the_same_results(store, tmp_path):
    args = ["train", "--store", store, "--method", "fedavg", "--name", "x", "--kernel", "torch", "--clients", "5",
            "--rounds", "6", "--participation", "0.4", "--local-test", "proportional", "--quiet"]  # fmt: skip
    _train(*args[1:-1], "--out", tmp_path / "u")
    killed = subprocess.run(
        [sys.executable, "-m", "fedfeat", *map(str, args), "--out", str(tmp_path / "k"), "--checkpoint-every", "2"],
        env=dict(ENV, FEDFEAT_FAULT="after-round-5"), capture_output=True, text=True,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    r = runner.invoke(app, ["train", "--resume", str(tmp_path / "k" / "x"), "--quiet"])
    assert r.exit_code == 0 and "after round 4" in r.output, r.output
    a, b = load_results(tmp_path / "u" / "x"), load_results(tmp_path / "k" / "x")
    assert set(a) == set(b) == {"rounds", "class_acc", "client_acc", "confusion"}
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_stacked_runs_write_the_results_of_their_own_runs(store, tmp_path):
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.train import train, train_stacked

    base = {"store": str(store), "method": "fedavg", "clients": 4, "rounds": 2, "participation": 0.5,
            "kernel": "torch"}  # fmt: skip
    cfgs = [resolve_config({**base, "seed": s, "out": str(tmp_path / "s"), "name": f"r{s}"}, None, None)
            for s in (0, 1)]  # fmt: skip
    train_stacked(cfgs, log=lambda *a: None)
    for s in (0, 1):
        one = train(resolve_config({**base, "seed": s, "out": str(tmp_path / "o"), "name": f"r{s}"}, None, None),
                    progress=False, log=lambda *a: None)  # fmt: skip
        got, want = load_results(tmp_path / "s" / f"r{s}"), load_results(one)
        assert set(got) == {"rounds", "class_acc", "confusion"}
        np.testing.assert_array_equal(got["confusion"], want["confusion"])
        np.testing.assert_allclose(got["class_acc"], want["class_acc"], atol=1e-9)
