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


@pytest.fixture()
def tiny_tpg(monkeypatch):
    """Three of FedTPG's nine datasets, 6 / 4 / 8 classes (base 3 / 2 / 4: one client each at blocks of 20), D = 16;
    the live stand-ins (the prompt rows) 6 + 3 images per class."""
    import dataclasses

    import fedfeat.runs.standin as standin

    three = ["caltech101", "oxford_pets", "dtd"]
    sh = dict(train_per_class=10, test_per_class=4, dim=16, templates=1)
    shapes = {(d, "ViT-B-16"): dict(classes=k, **sh) for d, k in zip(three, (6, 4, 8))}
    shapes[("fedtpg-9", "ViT-B-16")] = {"combine": ",".join(three)}
    monkeypatch.setattr(R, "SYNTH_SHAPES", shapes)
    monkeypatch.setattr(standin, "LIVE_TRAIN", 6)
    monkeypatch.setattr(standin, "LIVE_TEST", 3)
    for name in ("fedtpg-base", "fedtpg-new", "fedtpg-hm"):
        t = R.TABLES[name]
        cols = [c for c in t.columns if c.domain in three]
        rows = [r if r.method == "zeroshot" else dataclasses.replace(r, params={"n_ctx": "2", "local_epochs": "1"})
                for r in t.rows]  # fmt: skip
        paper = {k: [v[i] for i, c in enumerate(t.columns) if c.domain in three] for k, v in t.paper.items()}
        monkeypatch.setitem(R.TABLES, name, dataclasses.replace(t, columns=cols, rows=rows, paper=paper,
                                                                fixed={**t.fixed, "clients": 3}))  # fmt: skip
    return three


def test_fedtpg_tables_are_its_cross_class_setting():
    t = R.TABLES["fedtpg-base"]
    assert [c.domain for c in t.columns] == ["caltech101", "oxford_flowers", "fgvc_aircraft", "ucf101", "oxford_pets",
                                             "food101", "dtd", "stanford_cars", "sun397"]  # fmt: skip
    assert {(c.settings["partition"], c.settings["base_novel"]) for c in t.columns} == {
        ("class-blocks", True)
    }
    assert t.fixed == {"clients": 30, "participation": 1.0, "rounds": 500} and t.backbone == "ViT-B-16"
    assert t.paper["FedTPG"][0] == 97.2 and t.paper_avg["FedTPG"] == 73.61
    assert R.TABLES["fedtpg-new"].paper_avg["FedTPG"] == 76.24 and R.TABLES["fedtpg-hm"].paper == {}
    # 30 clients: each dataset's base classes (ceil(n / 2)) in blocks of 20, rounded as np.around does
    import math

    import numpy as np

    n = {"caltech101": 100, "oxford_flowers": 102, "fgvc_aircraft": 100, "ucf101": 101, "oxford_pets": 37,
         "food101": 101, "dtd": 47, "stanford_cars": 196, "sun397": 397}  # fmt: skip
    assert {k: R.SYNTH_SHAPES[(k, "ViT-B-16")]["classes"] for k in n} == n
    assert sum(max(1, int(np.around(math.ceil(k / 2) / 20))) for k in n.values()) == 30


def test_fedtpg_tables_run_on_combined_stand_ins(tiny_tpg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(store_root=tmp_path / "cache", synthetic=True, seeds=1, rounds=1, out=tmp_path / "runs",
              log=lambda *a: None)  # fmt: skip
    base = {(c["row"], c["column"]): c for c in json.loads(R.reproduce("fedtpg-base", fmt="json", **kw))}
    new = {(c["row"], c["column"]): c for c in json.loads(R.reproduce("fedtpg-new", fmt="json", **kw))}
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/summary.json")]
    # the three tables read the same three runs (zero-shot on the feature stand-in, the prompt rows on the live one)
    assert sorted(s["method"] for s in runs) == ["fedtpg", "promptfl", "zeroshot"]
    for s in runs:
        assert s["partition"] == "b2n+class-blocks-b20-shot8-c3-s43"
        assert set(s["domain_novel_acc"]) == set(tiny_tpg)
        row = {"fedtpg": "FedTPG", "promptfl": "PromptFL", "zeroshot": "CLIP (zero-shot)"}[s["method"]]
        for col, dom in zip(("Caltech", "Pets", "DTD"), tiny_tpg):
            assert base[(row, col)]["mean"] == pytest.approx(s["domain_base_acc"][dom])
            assert new[(row, col)]["mean"] == pytest.approx(s["domain_novel_acc"][dom])
    assert base[("FedTPG", "Caltech")]["paper"] == 97.2 and new[("FedTPG", "DTD")]["paper"] == 61.7
    assert base[("CLIP (zero-shot)", "Caltech")]["paper"] is None  # no CLIP numbers at hand
    md = R.reproduce("fedtpg-hm", fmt="markdown", **kw)
    assert "SYNTHETIC STAND-IN" in md and "| FedTPG |" in md and "prints no harmonic mean" in md
    assert "| CLIP (zero-shot) |" in md


def _zs_by_hand(x, y, text, vocab):
    """Zero-shot accuracy (%) of the rows of ``y`` in ``vocab``, each the argmax of cos(image, text) over ``vocab``."""
    import numpy as np

    rows = np.isin(y, vocab)
    t = text[vocab] / np.linalg.norm(text[vocab], axis=1, keepdims=True)
    pred = np.asarray(vocab)[(x[rows] @ t.T).argmax(1)]
    return 100 * float((pred == y[rows]).mean())


@pytest.mark.parametrize("combined", [False, True])
def test_zeroshot_base_to_novel_is_zero_shot_over_each_vocabulary(tmp_path, combined):
    """``--method zeroshot --base-novel``: base_acc / test_acc (novel) / hm, and per dataset of a combined store
    domain_base_acc / domain_novel_acc / domain_hm, are CLIP zero-shot accuracies over the restricted vocabularies
    (each dataset's first ceil(n / 2) classes base, the rest novel), recomputed here from the store's features and
    text embeddings."""
    import math

    import numpy as np
    from helpers_clip import run_cli

    from fedfeat.partition.openvocab import harmonic_mean
    from fedfeat.store.combine import combine_stores
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    q = {"stats": False, "log": lambda *a: None}
    sp = dict(dim=8, train_per_class=6, test_per_class=6, templates=1, s=0.3)
    a = write_synthetic_store(tmp_path / "a.zarr", SynthParams(classes=5, **sp), **q)
    stores, names = [a], ["a"]
    if combined:
        b = write_synthetic_store(tmp_path / "b.zarr", SynthParams(classes=4, seed=1, **sp), **q)
        st = combine_stores(tmp_path / "ab.zarr", [a.path, b.path], ["pets", "cars"], log=lambda *a: None)
        stores, names = [a, b], ["pets", "cars"]
    else:
        st = a
    r = run_cli(["train", "--store", st.path, "--method", "zeroshot", "--base-novel", "--partition", "iid",
                 "--clients", 2, "--rounds", 1, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    s = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert s["partition"].startswith("b2n+")
    x = st.features("test").astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y, text = st.labels("test"), st.text_features().astype(np.float64)
    text = text[0]  # [T, K, D]: the first template ("first", zeroshot's default)
    base, novel, per = [], [], {}
    off = 0
    for name, src in zip(names, stores):
        n = src.n_classes
        b_, n_ = list(range(off, off + math.ceil(n / 2))), list(range(off + math.ceil(n / 2), off + n))
        base += b_
        novel += n_
        per[name] = (_zs_by_hand(x, y, text, b_), _zs_by_hand(x, y, text, n_))
        off += n
    if combined:  # each dataset over its own vocabulary: the overall accuracies pool the per-dataset hits
        nb = {k: np.isin(y, v).sum() for k, v in (("b", base), ("n", novel))}
        sizes = {name: (np.isin(y, np.arange(o, o + src.n_classes)[: math.ceil(src.n_classes / 2)]).sum(),
                        np.isin(y, np.arange(o, o + src.n_classes)[math.ceil(src.n_classes / 2):]).sum())
                 for name, src, o in zip(names, stores, (0, stores[0].n_classes))}  # fmt: skip
        want_base = sum(per[k][0] * sizes[k][0] for k in names) / nb["b"]
        want_novel = sum(per[k][1] * sizes[k][1] for k in names) / nb["n"]
        for k in names:
            assert s["domain_base_acc"][k] == pytest.approx(per[k][0])
            assert s["domain_novel_acc"][k] == pytest.approx(per[k][1])
            assert s["domain_hm"][k] == pytest.approx(harmonic_mean(per[k][1], per[k][0]))
    else:
        want_base, want_novel = _zs_by_hand(x, y, text, base), _zs_by_hand(x, y, text, novel)
        assert "domain_base_acc" not in s
    assert s["base_acc"] == pytest.approx(want_base)
    assert s["final_acc"] == pytest.approx(want_novel)
    assert s["hm"] == pytest.approx(harmonic_mean(want_novel, want_base))
    # the restriction matters on this store: over all classes, some novel test image is predicted as a base class
    rows = np.isin(y, novel)
    assert np.isin((x[rows] @ (text / np.linalg.norm(text, axis=1, keepdims=True)).T).argmax(1), base).any()
