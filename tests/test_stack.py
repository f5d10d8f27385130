"""Stacked runs (``fedfeat.runs.stack``) equal the same runs made one by one with the torch program: seeds,
participation and hyperparameters differing within one stack, ragged clients, several epochs."""

from __future__ import annotations

import pytest
import torch
from helpers_clip import run_cli

from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.base import stackable
from fedfeat.partition.make import make_partition
from fedfeat.runs.stack import run_stacked
from fedfeat.store.featurestore import FeatureStore


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("stack") / "s.zarr"
    r = run_cli(["synth", "--out", out, "--dim", "32", "--train-per-class", "40", "--test-per-class", "15",
                 "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    st = FeatureStore.open(out)
    part = make_partition(st.labels("train"), "dirichlet", clients=8, alpha=0.3, seed=0)
    return load_run_data(st, part)


@pytest.fixture(scope="module")
def data64(data):
    """float64 for the torch program's comparison (its sums are reordered: float32 noise is not the point); the
    fused kernels run on the float32 data (what they compile for anyway) and must agree bit for bit."""
    import dataclasses

    return dataclasses.replace(
        data,
        train_x=data.train_x.double(),
        test_x=data.test_x.double(),
        text_all=data.text_all.double(),
        memo=None,
    )


def _data(kernel, data, data64):
    return data if kernel == "fused" else data64


def _one_by_one(name, sets, seed, part, data, rounds, kernel="torch"):
    return run_federated(get_method(name, sets), data, rounds=rounds, participation=part, seed=seed,
                         engine="batched", kernel=kernel)  # fmt: skip


def _compare(name, cases, data, rounds=3, kernel="torch"):
    """``cases``: (sets, seed, participation) per run; stacked = one by one, weights and every metric row (the
    fused kernels: bit for bit)."""
    methods = [get_method(name, sets) for sets, _, _ in cases]
    got = run_stacked(methods, data, rounds=rounds, participation=[c[2] for c in cases],
                      seeds=[c[1] for c in cases], kernel=kernel)  # fmt: skip
    for (sets, seed, part), res in zip(cases, got):
        want_w, want_rows = _one_by_one(name, sets, seed, part, data, rounds, kernel)
        w, rows = res
        for k in want_w:
            if kernel == "fused":
                assert torch.equal(w[k], want_w[k]), k
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
            assert set(a) == set(b)  # every method's own metrics (fedavg_head_acc, ratio_weights, ...)
            timings = {k for k in b if k.startswith("sec") or k.endswith("seconds")}
            for key in set(b) - timings - {"train_loss", "clients", "per_class_acc"}:
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
    return got


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_fedavg_stack_equals_one_by_one(data, data64, kernel):
    cases = [
        ({"lr": "0.01"}, 0, 0.5),
        ({"lr": "0.05", "momentum": "0.5"}, 0, 0.5),  # same data order, other hyperparameters
        ({"lr": "0.01", "weight_decay": "0.01", "batch_size": "50"}, 1, 0.5),  # another seed: other clients
        ({"lr": "0.02", "logit_scale": "10"}, 2, 1.0),  # all clients
    ]
    got = _compare("fedavg", cases, _data(kernel, data, data64), kernel=kernel)
    # the runs really differ (a stack that ran one run R times would fail above, this pins it)
    assert len({round(rows[-1]["train_loss"], 6) for _, rows in got}) == 4


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_fedprox_stack_with_two_epochs(data, data64, kernel):
    cases = [({"mu": "0.1", "local_epochs": "2"}, 0, 0.5), ({"mu": "1.0", "local_epochs": "2"}, 3, 0.5)]
    _compare("fedprox", cases, _data(kernel, data, data64), rounds=2, kernel=kernel)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_fst_cbdg_stack_equals_one_by_one(data, data64, kernel):
    cases = [
        ({}, 0, 0.5),
        ({"sigma": "2", "lam": "0.5"}, 0, 0.5),  # same seed: shared noise bank, other losses
        ({"beta": "0.5", "gamma": "0.5"}, 1, 0.5),  # other seed, other synthetic counts
        ({"synthetic_loss": "sum", "aggregation": "weighted", "self_training": "false"}, 2, 1.0),
        ({"synthetic_draw": "iteration", "balance": "equal", "logit_scale": "5"}, 0, 0.5),
    ]
    _compare("fst-cbdg", cases, _data(kernel, data, data64), kernel=kernel)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_fedntd_stack_equals_one_by_one(data, data64, kernel):
    cases = [({}, 0, 0.5), ({"tau": "3", "beta": "0.5"}, 1, 0.5), ({"lr": "0.05"}, 0, 1.0)]
    _compare("fedntd", cases, _data(kernel, data, data64), kernel=kernel)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_fedavgm_and_fednova_stack(data, data64, kernel):
    """Methods that differ from FedAvg in their server step only (per run: its own hooks, its own state)."""
    d = _data(kernel, data, data64)
    cases = [({}, 0, 0.5), ({"server_momentum": "0.5", "server_lr": "0.5"}, 1, 0.5), ({"lr": "0.05"}, 0, 1.0)]
    _compare("fedavgm", cases, d, kernel=kernel)
    cases = [
        ({}, 0, 0.5),
        ({"mu": "0.1", "tau_eff": "steps"}, 1, 0.5),  # FedProx's local term beside a run without it
        ({"gmf": "0.5", "weights": "population", "momentum": "0.5"}, 2, 1.0),
    ]
    _compare("fednova", cases, d, kernel=kernel)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_tau_norm_stack_evaluates_each_runs_head(data, data64, kernel):
    """fedavg-tau-norm's evaluated head is its own (``predict``): the stack evaluates it per run; its round metric
    (the plain head's accuracy) and final weights (both heads) equal the runs made alone."""
    cases = [({}, 0, 0.5), ({"tau": "0.5", "bias": "keep"}, 1, 0.5), ({"tau": "0"}, 0, 1.0)]
    got = _compare("fedavg-tau-norm", cases, _data(kernel, data, data64), kernel=kernel)
    assert all("W_tau" in w and "fedavg_head_acc" in rows[-1] for w, rows in got)


def test_fed_focal_stack_equals_one_by_one(data64):
    cases = [({}, 0, 0.5), ({"gamma": "0"}, 1, 0.5), ({"gamma": "0.5", "lr": "0.05"}, 0, 1.0)]
    _compare("fed-focal", cases, data64)


def test_ratio_loss_stack_equals_one_by_one(data64):
    """Each run's class weights (its own monitor on its own seeded auxiliary set) ride along per virtual client."""
    common = {"aux_per_class": "5", "local_epochs": "2", "batch_size": "16"}
    cases = [
        (common, 0, 0.5),
        ({**common, "ratio_beta": "0.5"}, 1, 0.5),  # another seed: another auxiliary set
        ({**common, "aux_per_class": "8", "lr": "0.05"}, 0, 1.0),  # same seed, another set size
    ]
    got = _compare("ratio-loss", cases, data64)
    assert len({tuple(rows[-1]["ratio_weights"]) for _, rows in got}) == 3


SERVER_STEP = {  # small settings of the methods whose server step is their own (stacked: the local step only)
    "ccvr": {"virtual_per_class": "20", "calibrate": "every", "calib_epochs": "1"},
    "feddf": {
        "server_data": "train",
        "val_data": "train",
        "val_size": "40",
        "server_size": "60",
        "distill_steps": "5",
        "distill_batch": "16",
    },
    "fedbe": {"server_data": "train", "server_size": "60", "samples": "2"},
    "creff": {"num_features": "4", "match_steps": "3", "crt_epochs": "2", "grad_repeats": "2"},
    "clip2fl": {
        "num_features": "4",
        "match_steps": "3",
        "crt_epochs": "2",
        "grad_repeats": "2",
        "pcl_repeats": "2",
    },
}


@pytest.mark.parametrize("kernel", ["torch", "fused"])
@pytest.mark.parametrize("name", sorted(SERVER_STEP))
def test_server_step_methods_stack(data, data64, name, kernel):
    """Local training batched over all runs' clients; each run's own server step (its seeded sets, its state)."""
    from fedfeat.engine.rounds import resolve_kernel

    base = {**SERVER_STEP[name], "local_epochs": "2"}
    if (
        kernel == "fused"
        and resolve_kernel("auto", get_method(name, base), "batched", torch.device("cpu")) != kernel
    ):
        pytest.skip(f"{name} has no {kernel} kernel")
    cases = [(base, 0, 0.5), ({**base, "lr": "0.05"}, 1, 0.5), (base, 2, 1.0)]
    if name == "clip2fl":
        cases[1][0].update(kd_alpha="0.5", kd_temperature="2")
    _compare(name, cases, _data(kernel, data, data64), rounds=2, kernel=kernel)


def test_what_cannot_stack_is_refused(data):
    with pytest.raises(FedfeatError, match="cannot be stacked"):
        run_stacked([get_method("fedavg", {}), get_method("fedavg", {"batch_size": "10"})], data, rounds=1,
                    participation=1.0, seeds=[0, 0])  # fmt: skip
    with pytest.raises(FedfeatError, match="cannot be stacked"):
        run_stacked([get_method("fed-mp", {})], data, rounds=1, participation=1.0, seeds=[0])
    with pytest.raises(FedfeatError, match="cannot be stacked"):  # one method per stack
        run_stacked([get_method("fedavg", {}), get_method("fedavgm", {})], data, rounds=1, participation=1.0,
                    seeds=[0, 0])  # fmt: skip


def test_a_diverging_run_stops_alone(data64):
    data = data64
    cases = [get_method("fedavg", {"lr": "1e300"}), get_method("fedavg", {})]
    bad, good = run_stacked(cases, data, rounds=3, participation=0.5, seeds=[0, 0], kernel="torch")
    assert isinstance(bad, FedfeatError) and "non-finite" in str(bad)
    want_w, _ = _one_by_one("fedavg", {}, 0, 0.5, data, 3)
    torch.testing.assert_close(good[0]["W"], want_w["W"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method,sets", [("fst-cbdg", "sigma=0.5,2"), ("fedavg-tau-norm", "tau=0.5,1")])
def test_sweep_stacks_into_ordinary_run_directories(tmp_path, method, sets):
    """``fedfeat sweep`` (stacking on by default): each point an ordinary run directory, bit for bit the run
    made alone (``--no-stack``) with the fused kernels (tau-norm: its own evaluated head and saved weights)."""
    import json

    store = tmp_path / "s.zarr"
    r = run_cli(["synth", "--out", store, "--dim", "16", "--train-per-class", "20", "--test-per-class", "8",
                 "--classes", "4", "--templates", "1", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    common = ["sweep", "--method", method, "--store", store, "--clients", "6", "--participation", "0.5",
              "--rounds", "2", "--seed", "0,1", "--set", sets, "--quiet"]  # fmt: skip
    for mode in ("stack", "no-stack"):
        r = run_cli([*common, "--out", tmp_path / mode, f"--{mode}"])
        assert r.exit_code == 0, (r.output, r.exception)
    runs = {}
    for mode in ("stack", "no-stack"):
        for d in sorted((tmp_path / mode).iterdir()):
            s = json.loads((d / "summary.json").read_text())
            rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            runs.setdefault(d.name, {})[mode] = (s, rows, (d / "weights.safetensors").read_bytes())
    assert len(runs) == 4
    for both in runs.values():
        (sa, ra, wa), (sb, rb, wb) = both["stack"], both["no-stack"]
        assert (
            sa["stacked_runs"] == 4 and "stacked_runs" not in sb and sa["kernel"] == sb["kernel"] == "fused"
        )
        assert wa == wb
        for key in ("test_acc", "train_loss", "pseudo_label_acc", "fedavg_head_acc", "clients"):
            assert [x.get(key) for x in ra] == [x.get(key) for x in rb], key


@pytest.mark.parametrize("name", sorted(stackable()))
def test_torch_stack_is_each_methods_own_step_loss(data, name):
    """The engine's stacked torch program runs each run's own ``step_loss`` and optimiser in lockstep (one
    ``autograd.grad`` for all runs; the gradient of a sum is each run's own): stacked = alone bit for bit, on float32
    data, for every stackable method (a method that stacks needs nothing written for it in ``runs/stack.py``)."""
    small = {"ratio-loss": {"aux_per_class": "5"}, **SERVER_STEP}
    base = {**small.get(name, {}), "local_epochs": "2", "batch_size": "16"}
    other = {**base, "lr": "0.05", "momentum": "0"}
    methods = [get_method(name, base), get_method(name, other), get_method(name, base)]
    cases = [(base, 0, 0.5), (other, 1, 0.5), (base, 2, 1.0)]
    got = run_stacked(methods, data, rounds=2, participation=[c[2] for c in cases], seeds=[c[1] for c in cases],
                      kernel="torch")  # fmt: skip
    for (sets, seed, part), (w, rows) in zip(cases, got):
        want_w, want_rows = _one_by_one(name, sets, seed, part, data, 2)
        for k in want_w:
            assert torch.equal(w[k], want_w[k]), (name, k)
        assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in want_rows]
