"""The privacy tables (issue 41): ``reproduce dp-client`` / ``dp-sample`` run fedavg, fst-cbdg, clip2fl and promptfl
(client level) and the sample-level methods at no DP and at three target epsilons, on tiny stand-ins; every DP run
spent at most its target."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fedfeat.runs import reproduce as R


@pytest.fixture()
def tiny(monkeypatch):
    import fedfeat.runs.standin as standin

    monkeypatch.setattr(R, "SYNTH_SHAPES", {("cifar10", "RN50"): dict(
        classes=4, train_per_class=40, test_per_class=8, dim=16, templates=1)})  # fmt: skip
    monkeypatch.setattr(standin, "LIVE_TRAIN", 16)
    monkeypatch.setattr(standin, "LIVE_TEST", 3)
    fast = {
        "clip2fl": {"crt_epochs": "2", "match_steps": "2", "local_epochs": "1"},
        "promptfl": {"n_ctx": "2"},
    }
    for name in ("dp-client", "dp-sample"):
        t = R.TABLES[name]
        rows = [dataclasses.replace(r, params={**r.params, **fast.get(r.method, {})}) for r in t.rows]
        monkeypatch.setitem(
            R.TABLES, name, dataclasses.replace(t, rows=rows, fixed={**t.fixed, "clients": 4})
        )


@pytest.mark.parametrize("name", ["dp-client", "dp-sample"])
def test_privacy_table_runs_on_stand_ins(tiny, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    cells = json.loads(R.reproduce(name, store_root=tmp_path / "cache", synthetic=True, seeds=1, rounds=1,
                                   out=tmp_path / "runs", fmt="json", log=lambda *a: None))  # fmt: skip
    t = R.TABLES[name]
    assert {(c["row"], c["column"]) for c in cells if c["mean"] is not None} == {
        (r.label, c.label) for r in t.rows for c in t.columns
    }
    spent = {}
    for s in Path(tmp_path / "runs").rglob("summary.json"):
        d = json.loads(s.read_text())
        if "dp" in d:
            assert d["dp"]["mode"] == name.split("-")[1]
            assert 0 < d["dp"]["epsilon"] <= d["dp"]["target_epsilon"] * (1 + 1e-9)
            spent.setdefault(d["method"], set()).add(d["dp"]["target_epsilon"])
    assert spent == {r.method: {8.0, 4.0, 1.0} for r in t.rows}
    assert "eps = 1" in R.reproduce(name, store_root=tmp_path / "cache", synthetic=True, seeds=1, rounds=1,
                                    out=tmp_path / "runs", fmt="markdown", log=lambda *a: None)  # fmt: skip
