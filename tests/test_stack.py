"""Stacked runs (``fedfeat.stack``) equal the same runs made one by one with the torch program: seeds,
participation and hyperparameters differing within one stack, ragged clients, several epochs."""

from __future__ import annotations

import pytest
import torch
from helpers_clip import run_cli

from fedfeat.engine import load_run_data, run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.partition import make_partition
from fedfeat.stack import run_stacked
from fedfeat.store import FeatureStore


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("stack") / "s.zarr"
    r = run_cli(["synth", "--out", out, "--dim", "32", "--train-per-class", "40", "--test-per-class", "15",
                 "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(out)
    part = make_partition(st.labels("train"), "dirichlet", clients=8, alpha=0.3, seed=0)
    d = load_run_data(st, part)
    d.train_x, d.test_x = d.train_x.double(), d.test_x.double()  # the comparison, not float32 noise
    d.text_all = d.text_all.double()
    return d


def _one_by_one(name, sets, seed, part, data, rounds):
    return run_federated(get_method(name, sets), data, rounds=rounds, participation=part, seed=seed,
                         engine="batched", kernel="torch")  # fmt: skip


def _compare(name, cases, data, rounds=3):
    """``cases``: (sets, seed, participation) per run; stacked = one by one, weights and every metric row."""
    methods = [get_method(name, sets) for sets, _, _ in cases]
    got = run_stacked(methods, data, rounds=rounds, participation=[c[2] for c in cases],
                      seeds=[c[1] for c in cases])  # fmt: skip
    for (sets, seed, part), res in zip(cases, got):
        want_w, want_rows = _one_by_one(name, sets, seed, part, data, rounds)
        w, rows = res
        for k in want_w:
            torch.testing.assert_close(w[k], want_w[k], atol=1e-5, rtol=1e-5)
        assert len(rows) == len(want_rows) == rounds + 1
        for a, b in zip(rows, want_rows):
            assert a["clients"] == b["clients"] and a["bytes_up"] == b["bytes_up"]
            assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)
            assert a["per_class_acc"] == pytest.approx(b["per_class_acc"], abs=1e-9)
            if b["train_loss"] is not None:
                assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
            for key in ("pseudo_label_acc", "pseudo_label_acc_all"):
                assert a.get(key) == pytest.approx(b.get(key), abs=1e-9)
    return got


def test_fedavg_stack_equals_one_by_one(data):
    cases = [
        ({"lr": "0.01"}, 0, 0.5),
        ({"lr": "0.05", "momentum": "0.5"}, 0, 0.5),  # same data order, other hyperparameters
        ({"lr": "0.01", "weight_decay": "0.01", "batch_size": "50"}, 1, 0.5),  # another seed: other clients
        ({"lr": "0.02", "logit_scale": "10"}, 2, 1.0),  # all clients
    ]
    got = _compare("fedavg", cases, data)
    # the runs really differ (a stack that ran one run R times would fail above, this pins it)
    assert len({round(rows[-1]["train_loss"], 6) for _, rows in got}) == 4


def test_fedprox_stack_with_two_epochs(data):
    cases = [({"mu": "0.1", "local_epochs": "2"}, 0, 0.5), ({"mu": "1.0", "local_epochs": "2"}, 3, 0.5)]
    _compare("fedprox", cases, data, rounds=2)


def test_fst_cbdg_stack_equals_one_by_one(data):
    cases = [
        ({}, 0, 0.5),
        ({"sigma": "2", "lam": "0.5"}, 0, 0.5),  # same seed: shared noise bank, other losses
        ({"beta": "0.5", "gamma": "0.5"}, 1, 0.5),  # other seed, other synthetic counts
        ({"synthetic_loss": "sum", "aggregation": "weighted", "self_training": "false"}, 2, 1.0),
        ({"synthetic_draw": "iteration", "balance": "equal", "logit_scale": "5"}, 0, 0.5),
    ]
    _compare("fst-cbdg", cases, data)


def test_what_cannot_stack_is_refused(data):
    with pytest.raises(FedfeatError, match="cannot be stacked"):
        run_stacked([get_method("fedavg", {}), get_method("fedavg", {"batch_size": "10"})], data, rounds=1,
                    participation=1.0, seeds=[0, 0])  # fmt: skip
    with pytest.raises(FedfeatError, match="cannot be stacked"):
        run_stacked([get_method("fedntd", {})], data, rounds=1, participation=1.0, seeds=[0])


def test_a_diverging_run_stops_alone(data):
    cases = [get_method("fedavg", {"lr": "1e300"}), get_method("fedavg", {})]
    bad, good = run_stacked(cases, data, rounds=3, participation=0.5, seeds=[0, 0])
    assert isinstance(bad, FedfeatError) and "non-finite" in str(bad)
    want_w, _ = _one_by_one("fedavg", {}, 0, 0.5, data, 3)
    torch.testing.assert_close(good[0]["W"], want_w["W"], atol=1e-5, rtol=1e-5)


def test_sweep_stacks_into_ordinary_run_directories(tmp_path):
    """``fedfeat sweep --stack always``: each point an ordinary run directory with the one-by-one run's metrics."""
    import json

    store = tmp_path / "s.zarr"
    r = run_cli(["synth", "--out", store, "--dim", "16", "--train-per-class", "20", "--test-per-class", "8",
                 "--classes", "4", "--templates", "1", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    common = ["sweep", "--method", "fst-cbdg", "--store", store, "--clients", "6", "--participation", "0.5",
              "--rounds", "2", "--seed", "0,1", "--set", "sigma=0.5,2", "--kernel", "torch", "--quiet"]  # fmt: skip
    for mode in ("always", "never"):
        r = run_cli([*common, "--out", tmp_path / mode, "--stack", mode])
        assert r.exit_code == 0, (r.output, r.exception)
    runs = {}
    for mode in ("always", "never"):
        for d in sorted((tmp_path / mode).iterdir()):
            s = json.loads((d / "summary.json").read_text())
            rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            runs.setdefault(d.name, {})[mode] = (s, rows)
    assert len(runs) == 4
    for both in runs.values():
        (sa, ra), (sb, rb) = both["always"], both["never"]
        assert (
            sa["stacked_runs"] == 4 and "stacked_runs" not in sb and sa["kernel"] == sb["kernel"] == "torch"
        )
        assert [x["test_acc"] for x in ra] == pytest.approx([x["test_acc"] for x in rb], abs=1e-9)
        assert [x["train_loss"] for x in ra[1:]] == pytest.approx([x["train_loss"] for x in rb[1:]], abs=1e-5)
    r = run_cli([*common, "--out", tmp_path / "bad", "--stack", "sometimes"])
    assert r.exit_code != 0 and "unknown stack mode 'sometimes'" in r.output
