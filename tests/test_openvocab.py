"""The open-vocabulary setting (Fed-MP): the split, the local and query splits, the metrics, the presets."""

import json

import numpy as np
import pytest
import reference_partitions as ref
import torch
from typer.testing import CliRunner

import fedfeat.partition as P
from fedfeat.cli.app import app
from fedfeat.partition import openvocab as ov

runner = CliRunner()


@pytest.mark.parametrize("seed", [-1, 0, 1])
def test_caltech_shape_split_equals_the_reference(seed):
    """102 classes, 10 clients: 102 // 11 = 9 disjoint classes each, exactly the 12 classes left over are novel,
    and the clients equal Fed-MP's algorithm for the same seed convention (i / i+1 / i+2)."""
    labels = np.random.RandomState(5).permutation(np.repeat(np.arange(102), 15))
    ours, novel = P.disjoint_classes(labels, 10, 10, seed=seed, n_classes=102)
    theirs, their_novel = ref.fedmp_split_clients(labels, 102, 10, 10, seed_offset=seed + 1)
    assert [np.array_equal(a, v[1]) for a, v in zip(ours, theirs.values())] == [True] * 10
    classes = [set(labels[c].tolist()) for c in ours]
    assert [len(c) for c in classes] == [9] * 10 and len(set().union(*classes)) == 90
    assert len(novel) == 12 and set(novel.tolist()) == set(range(102)) - set().union(*classes)
    np.testing.assert_array_equal(novel, their_novel)


def test_macro_prf_on_a_hand_confusion_matrix():
    """Classes 0, 1, 2; class 2 is never predicted. Confusion (rows true, cols predicted):
    true 0: [2, 1, 0]; true 1: [0, 1, 0]; true 2: [1, 1, 0].
    P = [2/3, 1/3, 0], R = [2/3, 1, 0], F1 = [2/3, 1/2, 0] -> macro 1/3, 5/9, 7/18 (sklearn, zero_division=0)."""
    y = torch.tensor([0, 0, 0, 1, 2, 2])
    pred = torch.tensor([0, 0, 1, 1, 0, 1])
    p, r, f = ov.macro_prf(pred, y, torch.tensor([0, 1, 2]))
    assert (p, r, f) == pytest.approx((1 / 3, 5 / 9, 7 / 18), abs=1e-12)
    assert ov.harmonic_mean(60.0, 40.0) == pytest.approx(48.0) and ov.harmonic_mean(0.0, 0.0) == 0.0


def test_local_splits():
    labels = np.repeat(np.arange(3), 10)
    clients = [np.arange(0, 20), np.arange(20, 30)]  # classes 0+1 (10 shots each), class 2
    tr, va = ov.local_split(clients, labels, "paper")  # the last 2 of each class's 10 shots validate
    assert va[0].tolist() == [8, 9, 18, 19] and va[1].tolist() == [28, 29] and len(tr[0]) == 16
    tr, va = ov.local_split(clients, labels, "code")  # seed-0 permutation, floor(0.8 n) train
    perm = np.random.RandomState(0).permutation(20)
    assert tr[0].tolist() == perm[:16].tolist() and va[0].tolist() == perm[16:].tolist()
    tr, va = ov.local_split(clients, labels, "none")
    assert [len(v) for v in va] == [0, 0] and tr[1].tolist() == list(range(20, 30))
    y = np.repeat([4, 7], [10, 5])
    qv, qt = ov.query_split(y, "paper", 0)
    assert (y[qv] == 4).sum() == 2 and (y[qv] == 7).sum() == 1 and len(qt) == 12
    assert not set(qv) & set(qt)
    qv, qt = ov.query_split(y, "code", 0)
    assert len(qv) == 0 and qt.tolist() == list(range(15))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("ov") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--classes", "22", "--dim", "16", "--train-per-class", "30",
         "--test-per-class", "10", "--templates", "1", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def test_zeroshot_is_evaluated_over_the_novel_vocabulary(store, tmp_path):
    """22 classes, 3 clients: 5 classes each, 7 novel. The recorded accuracy is the argmax over the novel
    classes' prompts of the novel query images (here all 10 test images of each novel class: --query-val code)."""
    from fedfeat.store.featurestore import FeatureStore

    r = runner.invoke(
        app,
        ["train", "--store", str(store), "--method", "zeroshot", "--partition", "disjoint-classes", "--clients",
         "3", "--query-val", "code", "--out", str(tmp_path), "--name", "z", "--quiet"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "z" / "metrics.jsonl").read_text().splitlines()[0])
    st = FeatureStore.open(store)
    labels = st.labels("train")
    clients, novel = P.disjoint_classes(labels, 3, 10, seed=0, n_classes=22)
    base = sorted(set(range(22)) - set(novel.tolist()))
    x = torch.nn.functional.normalize(torch.from_numpy(st.features("test")).float(), dim=-1)
    t = torch.nn.functional.normalize(torch.from_numpy(st.text_features()[0]).float(), dim=-1)
    y = torch.from_numpy(st.labels("test"))

    def acc(classes):
        keep = torch.isin(y, torch.tensor(classes))
        pred = torch.tensor(classes)[(x[keep] @ t[classes].T).argmax(1)]
        return float((pred == y[keep]).double().mean()) * 100, pred, y[keep]

    novel_acc, pred, yn = acc(novel.tolist())
    assert row["test_acc"] == pytest.approx(novel_acc, abs=1e-9)
    assert row["base_acc"] == pytest.approx(acc(base)[0], abs=1e-9)
    p, rc, f = ov.macro_prf(pred, yn, torch.from_numpy(novel))
    assert (row["novel_precision"], row["novel_recall"], row["novel_f1"]) == pytest.approx(
        (100 * p, 100 * rc, 100 * f)
    )
    assert row["hm"] == pytest.approx(ov.harmonic_mean(row["test_acc"], row["base_acc"]))


def test_preset_checks_the_class_count(store, tmp_path):
    r = runner.invoke(app, ["train", "--store", str(store), "--preset", "caltech101", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "102 classes" in r.output and "22" in r.output
    cfg = __import__("fedfeat.runs.config", fromlist=["x"]).resolve_config({"preset": "ucf101"}, None, None)
    assert (cfg.partition, cfg.shots, cfg.clients, cfg.rounds, cfg.partition_seed) == (
        "disjoint-classes",
        10,
        10,
        2,
        -1,
    )
