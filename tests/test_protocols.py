"""Protocol options that combine with any scheme (issue 38): CoOp's base-to-novel split (``base_novel``: clients draw
from the first ceil(K/2) classes; novel / base accuracy over their own vocabularies and the harmonic mean) and few
shots per client class (``client_shots``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers_clip import run_cli, synth_store

from fedfeat.errors import FedfeatError
from fedfeat.partition.core import partition_key
from fedfeat.partition.make import make_partition
from fedfeat.partition.registry import parse_key
from fedfeat.report.plots import readable_partition

LABELS = np.random.RandomState(0).permutation(np.repeat(np.arange(11), 20))  # 11 classes: base = the first 6


@pytest.mark.parametrize("scheme,kw", [("iid", {}), ("dirichlet", {"alpha": 0.5, "min_size": 0}),
                                        ("shard", {"shards": 2}), ("pathological", {"classes_per_client": 3})])  # fmt: skip
def test_base_novel_draws_the_scheme_on_the_base_rows(scheme, kw):
    clients = {"pathological": 2, "shard": 3}.get(scheme, 4)  # a multiple of the 6 base classes where needed
    p = make_partition(LABELS, scheme, clients=clients, base_novel=True, **kw)
    m = math.ceil(11 / 2)  # CoOp subsample_classes: m = ceil(n / 2) = 6
    assert p.params["novel_classes"] == list(range(m, 11)) and p.params["base_novel"] is True
    # the same scheme on the base rows alone, positions mapped back: the same clients
    base_rows = np.flatnonzero(LABELS < m)
    ref = make_partition(LABELS[base_rows], scheme, clients=clients, n_classes=m, **kw)
    assert [c.tolist() for c in p.clients] == [base_rows[c].tolist() for c in ref.clients]
    key = partition_key(p)
    assert key == "b2n+" + partition_key(ref) and parse_key(key)["base_novel"] is True
    assert readable_partition(key).startswith("base-to-novel, ")


def test_client_shots_keep_the_first_k_of_each_class():
    full = make_partition(LABELS, "dirichlet", clients=3, alpha=1.0)
    p = make_partition(LABELS, "dirichlet", clients=3, alpha=1.0, client_shots=2)
    for a, b in zip(full.clients, p.clients):
        want = [
            x for i, x in enumerate(a) if sum(LABELS[a[:i]] == LABELS[x]) < 2
        ]  # first 2 of each class, in order
        assert b.tolist() == want
        assert np.bincount(LABELS[b]).max() <= 2
    assert partition_key(p) == "shots2+" + partition_key(full) and p.params["client_shots"] == 2
    assert parse_key(partition_key(p))["client_shots"] == "2"
    with pytest.raises(FedfeatError, match="client_shots must be >= 1"):
        make_partition(LABELS, "iid", clients=2, client_shots=0)
    with pytest.raises(FedfeatError, match="draws the test split too"):
        make_partition(LABELS, "dirichlet-joint", clients=2, alpha=0.5, base_novel=True, test_labels=LABELS)


def test_base_to_novel_run_reports_novel_base_and_their_harmonic_mean(tmp_path):
    from safetensors.torch import load_file

    from fedfeat.store.featurestore import FeatureStore

    store = synth_store(
        tmp_path / "s.zarr", dim=16, train_per_class=30, test_per_class=10
    )  # K = 10: base 0..4
    r = run_cli(["train", "--store", store, "--method", "fedavg", "--partition", "iid", "--clients", 4, "--rounds", 2,
                 "--base-novel", "--client-shots", 4, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = next((tmp_path / "runs").glob("*/summary.json")).parent
    s = json.loads((run / "summary.json").read_text())
    part = json.loads((run / "partition.json").read_text())
    st = FeatureStore.open(store)
    y = st.labels("train")
    held = np.concatenate([np.asarray(c) for c in part["clients"]])
    assert set(y[held]) == {0, 1, 2, 3, 4} and np.bincount(y[held]).max() <= 4 * 4  # 4 shots x 4 clients
    # by hand from the final head: novel test images over the novel classes, base ones over the base classes
    w = load_file(run / "weights.safetensors")
    x = st.features("test").astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    z = x @ w["W"].numpy().astype(np.float64).T + w["b"].numpy()
    ty = st.labels("test")
    nov, base = ty >= 5, ty < 5
    novel_acc = 100 * np.mean(5 + z[nov][:, 5:].argmax(1) == ty[nov])
    base_acc = 100 * np.mean(z[base][:, :5].argmax(1) == ty[base])
    assert s["final_acc"] == pytest.approx(novel_acc) and s["base_acc"] == pytest.approx(base_acc)
    assert s["hm"] == pytest.approx(2 * novel_acc * base_acc / (novel_acc + base_acc))
