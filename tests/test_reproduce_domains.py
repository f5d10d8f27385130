"""Paper tables of domain federations (issue 38): FedCLIP's PACS table (leave-one-domain-out, the whole target domain
tested, three source clients averaged uniformly) runs on a tiny domain-shift stand-in in every format, beside the
README's numbers."""

from __future__ import annotations

import json

import pytest

from fedfeat.runs import reproduce as R

PACS = "art_painting,cartoon,photo,sketch"


@pytest.fixture()
def tiny(monkeypatch):
    monkeypatch.setattr(R, "SYNTH_SHAPES", {
        ("pacs", "ViT-B-32"): dict(classes=7, dim=16, train_per_class=10, test_per_class=4, templates=1, domains=4,
                                   domain_names=PACS, domain_signal="0.64,0.7,1,0.49"),
    })  # fmt: skip


def test_fedclip_pacs_is_leave_one_domain_out_as_the_code_runs_it():
    t = R.TABLES["fedclip-pacs"]
    assert [c.settings["held_out"] for c in t.columns] == PACS.split(",")
    assert {c.settings["held_out_eval"] for c in t.columns} == {"all"} and t.fixed["clients"] == 3
    fedclip = next(r for r in t.rows if r.label == "FedCLIP")
    assert fedclip.params == {"local_epochs": "1", "batch_size": "32", "lr": "5e-5", "aggregation": "uniform"}
    assert t.paper["FedCLIP"] == [95.15, 95.36, 95.46, 94.99] and t.paper_avg["FedCLIP"] == 95.24
    assert R.SYNTH_SHAPES[("pacs", "ViT-B-32")]["domains"] == 4


def test_fedclip_pacs_runs_on_a_domain_stand_in(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(store_root=tmp_path / "cache", synthetic=True, seeds=1, rounds=1, out=tmp_path / "runs",
              log=lambda *a: None)  # fmt: skip
    cells = json.loads(R.reproduce("fedclip-pacs", fmt="json", **kw))
    by = {(c["row"], c["column"]): c for c in cells}
    assert by[("FedCLIP", "S")]["paper"] == 94.99 and by[("FedCLIP", "S")]["mean"] is not None
    assert by[("FedAVG (AlexNet)", "A")]["mean"] is None and "AlexNet" in by[("FedAVG (AlexNet)", "A")]["why"]
    # each column's runs hold its domain out, and test all of it (train + test split rows of that domain)
    for col, dom in zip("ACPS", PACS.split(",")):
        s = json.loads(next(p for p in (tmp_path / "runs").glob("fedclip*/summary.json")
                            if json.loads(p.read_text())["partition"].endswith(f"-ho{dom}-heall")).read_text())  # fmt: skip
        assert [k for k, v in s["domain_acc"].items() if v is not None] == [dom]
        assert by[("FedCLIP", col)]["mean"] == pytest.approx(s["final_acc"])
    md = R.reproduce("fedclip-pacs", fmt="markdown", **kw)
    assert "SYNTHETIC STAND-IN" in md and "| FedCLIP |" in md and "(95.24)" in md and "sketch held out" in md
