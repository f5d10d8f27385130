"""The cross-family table (issue 39): ``reproduce canon`` runs zero-shot, the linear heads, the training-free family,
the synthesis methods, the adapters and the prompt methods on one store, partition and seeds, and prints accuracy ±
std, megabytes communicated and compute seconds per method -- here on tiny stand-ins, at two seeds."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fedfeat.runs import reproduce as R

FAST = {"creff": {}, "clip2fl": {}}


@pytest.fixture()
def tiny(monkeypatch):
    import fedfeat.runs.standin as standin

    monkeypatch.setattr(R, "SYNTH_SHAPES", {("cifar100", "ViT-B-32"): dict(
        classes=6, train_per_class=40, test_per_class=8, dim=16, templates=1)})  # fmt: skip
    monkeypatch.setattr(standin, "LIVE_TRAIN", 8)
    monkeypatch.setattr(standin, "LIVE_TEST", 3)
    t = R.TABLES["canon"]
    fast = {"fedcocoop": {"batch_size": "8"}, "fedpft": {"server_epochs": "2"}}
    rows = [dataclasses.replace(r, params={**r.params, **fast.get(r.method, {})}) for r in t.rows]
    monkeypatch.setitem(R.TABLES, "canon", dataclasses.replace(t, rows=rows, fixed={**t.fixed, "clients": 3}))


def test_canon_lists_every_family():
    t = R.TABLES["canon"]
    methods = [r.method for r in t.rows]
    for m in ("zeroshot", "fedavg", "fedncm", "fed3r", "fedcof", "fedpft", "fst-cbdg", "fedclip", "promptfl",
              "fedkgcoop", "fedcocoop", "fedpgp", "promptfolio"):  # fmt: skip
        assert m in methods
    assert [c.metric for c in t.columns] == ["final_acc", "megabytes", "train_seconds"]
    assert R.derived_metric(t, "megabytes", {"bytes_up": 2**20, "bytes_down": 2**21}) == 3.0


def test_canon_runs_at_two_seeds_on_stand_ins(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cells = json.loads(R.reproduce("canon", store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=1,
                                   out=tmp_path / "runs", fmt="json", log=lambda *a: None))  # fmt: skip
    by = {(c["row"], c["column"]): c for c in cells}
    t = R.TABLES["canon"]
    for r in t.rows:
        acc = by[(r.label, "accuracy (%)")]
        assert acc["mean"] is not None and acc["n"] == 2, (r.label, acc)
        if r.method != "zeroshot":  # zero-shot trains nothing: no training seconds
            assert by[(r.label, "training seconds")]["mean"] is not None, (
                r.label
            )  # (its value: the benchmark's)
    # the training-free methods send statistics once; zero-shot sends nothing
    assert by[("zero-shot CLIP", "MB communicated")]["mean"] == 0
    assert by[("FedNCM (training-free)", "MB communicated")]["mean"] > 0
