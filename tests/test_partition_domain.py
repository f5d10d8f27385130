"""The ``domain`` partition scheme (issue 38): clients = domains, k clients per domain by FedOTP's
``Dataset_partition_domainnet`` (checked against a transcription that uses numpy's global generator, as the code
does), leave-one-domain-out, and fedavg / fedclip / promptfl / fedtpg training on a PACS-layout store with clients =
domains (the real encode path, a tiny CLIP)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_clip import run_cli

from fedfeat.errors import FedfeatError
from fedfeat.partition.core import partition_key
from fedfeat.partition.make import make_partition


class Forever(Exception):
    pass


def fedotp_reference(train_labels, test_labels, beta, n_parties=5, min_require_size=2, K=10):
    """HongxiaLee/FedOTP @ 506d68c utils/data_utils.py ``Dataset_partition_domainnet``, transcribed with the global
    numpy generator as the code uses it (state restored after); the pickle loading replaced by the label arrays."""
    state = np.random.get_state()
    try:
        min_size = 0
        N_train = train_labels.shape[0]
        net_dataidx_map_train, net_dataidx_map_test = {}, {}
        tries = 0
        while min_size < min_require_size:
            tries += 1
            if tries > 1:  # the same draws again (np.random.seed(0) per class): the code never ends
                raise Forever
            idx_batch_train = [[] for _ in range(n_parties)]
            idx_batch_test = [[] for _ in range(n_parties)]
            for k in range(K):
                train_idx_k = np.where(train_labels == k)[0]
                test_idx_k = np.where(test_labels == k)[0]
                np.random.seed(0)
                np.random.shuffle(train_idx_k)
                np.random.shuffle(test_idx_k)
                proportions = np.random.dirichlet(np.repeat(beta, n_parties))
                proportions = np.array(
                    [p * (len(idx_j) < N_train / n_parties) for p, idx_j in zip(proportions, idx_batch_train)]
                )
                proportions = proportions / proportions.sum()
                proportions_train = (np.cumsum(proportions) * len(train_idx_k)).astype(int)[:-1]
                proportions_test = (np.cumsum(proportions) * len(test_idx_k)).astype(int)[:-1]
                train_part_list = np.split(train_idx_k, proportions_train)
                test_part_list = np.split(test_idx_k, proportions_test)
                idx_batch_train = [
                    idx_j + idx.tolist() for idx_j, idx in zip(idx_batch_train, train_part_list)
                ]
                idx_batch_test = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch_test, test_part_list)]
                min_size_train = min([len(idx_j) for idx_j in idx_batch_train])
                min_size_test = min([len(idx_j) for idx_j in idx_batch_test])
                min_size = min(min_size_test, min_size_train)
        for j in range(n_parties):
            np.random.shuffle(idx_batch_train[j])
            np.random.shuffle(idx_batch_test[j])
            net_dataidx_map_train[j] = idx_batch_train[j]
            net_dataidx_map_test[j] = idx_batch_test[j]
        return net_dataidx_map_train, net_dataidx_map_test
    finally:
        np.random.set_state(state)


def _domain_data(seed=0, n_dom=3, K=10, per=(120, 90, 150), test=(40, 30, 50)):
    rng = np.random.default_rng(seed)
    lab = np.concatenate([rng.integers(0, K, n) for n in per[:n_dom]])
    dom = np.concatenate([np.full(n, d) for d, n in enumerate(per[:n_dom])])
    tl = np.concatenate([rng.integers(0, K, n) for n in test[:n_dom]])
    td = np.concatenate([np.full(n, d) for d, n in enumerate(test[:n_dom])])
    perm, tperm = rng.permutation(len(lab)), rng.permutation(len(tl))  # domains interleaved in store order
    return lab[perm], dom[perm], tl[tperm], td[tperm]


@pytest.mark.parametrize(("beta", "need"), [(0.1, 1), (0.5, 1), (0.5, 2), (5.0, 2), (0.05, 2)])
def test_k_clients_per_domain_equal_fedotps_split(beta, need):
    lab, dom, tl, td = _domain_data()
    names = ("clipart", "painting", "real")
    kw = dict(clients=15, per_domain=5, alpha=beta, domains=dom, test_labels=tl, test_domains=td, domain_names=names,
              min_require_size=need)  # fmt: skip
    refs = []
    for d in range(3):
        rows, trows = np.flatnonzero(dom == d), np.flatnonzero(td == d)
        try:
            refs.append((rows, trows, fedotp_reference(lab[rows], tl[trows], beta, 5, min_require_size=need)))
        except Forever:
            with pytest.raises(FedfeatError, match="redraw the same split forever"):
                make_partition(lab, "domain", **kw)
            return
    p = make_partition(lab, "domain", **kw)
    assert p.params["client_domains"] == [n for n in names for _ in range(5)]
    for d, (rows, trows, (ref_tr, ref_te)) in enumerate(refs):
        for j in range(5):
            assert p.clients[5 * d + j].tolist() == rows[ref_tr[j]].tolist()
            assert p.params["test_clients"][5 * d + j] == trows[ref_te[j]].tolist()


def test_one_client_per_domain_holds_its_domain():
    lab, dom, tl, td = _domain_data()
    p = make_partition(lab, "domain", clients=3, domains=dom, test_labels=tl, test_domains=td,
                       domain_names=("a", "b", "c"))  # fmt: skip
    assert partition_key(p) == "domain-pd1-c3-s0"
    for d in range(3):
        assert p.clients[d].tolist() == np.flatnonzero(dom == d).tolist()  # store order
        assert p.params["test_clients"][d] == np.flatnonzero(td == d).tolist()
    assert "test_rows" not in p.params


def test_leave_one_domain_out():
    lab, dom, tl, td = _domain_data()
    p = make_partition(lab, "domain", clients=2, domains=dom, test_labels=tl, test_domains=td,
                       domain_names=("a", "b", "c"), held_out="b")  # fmt: skip
    assert partition_key(p) == "domain-pd1-c2-s0-hob"
    assert p.params["client_domains"] == ["a", "c"]
    assert p.clients[1].tolist() == np.flatnonzero(dom == 2).tolist()
    assert p.params["test_rows"] == np.flatnonzero(td == 1).tolist()


def test_bad_domain_settings_are_one_line():
    lab, dom, tl, td = _domain_data()

    def err(**kw) -> str:
        with pytest.raises(FedfeatError) as e:
            make_partition(lab, "domain", **{"domains": dom, "test_labels": tl, "test_domains": td,
                                             "domain_names": ("a", "b", "c"), **kw})  # fmt: skip
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "pass --clients 3" in err(clients=10)
    assert "pass --clients 6" in err(clients=4, per_domain=2, alpha=0.5)
    assert "drop alpha" in err(clients=3, alpha=0.5)  # alpha cuts a domain among several clients
    p = make_partition(lab, "domain", clients=6, per_domain=2, domains=dom, test_labels=tl, test_domains=td)
    assert p.params["alpha"] == 0.1 and partition_key(p) == "domain-pd2-a0.1-c6-s0"  # FedOTP's --beta default
    assert "is not a domain of this store; its domains: a, b, c" in err(clients=2, held_out="x")
    assert "forever" in err(clients=60, per_domain=20, alpha=0.05)  # FedOTP's redraw never ends: refused
    with pytest.raises(FedfeatError, match="needs each row's domain"):
        make_partition(lab, "domain", clients=3)
    with pytest.raises(FedfeatError, match="does not draw by domain"):
        make_partition(lab, "iid", clients=3, domains=dom)


# ------------------------------------------------------------------ clients = domains, through train
@pytest.fixture(scope="module")
def pacs_store(tmp_path_factory):
    from helpers_clip import make_tiny_clip
    from test_data_domains import write_domain_folders

    d = tmp_path_factory.mktemp("pacs")
    tc = make_tiny_clip(d / "tc")
    root = write_domain_folders(d / "PACS")
    r = run_cli(["encode", "--dataset", "pacs", "--root", root, "--backbone", tc.config, "--pretrained", tc.weights,
                 "--out", d / "out", "--device", "cpu", "--batch-size", "16"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return next((d / "out").glob("*/*.zarr"))


@pytest.mark.parametrize("method", ["fedavg", "fedclip", "promptfl", "fedtpg"])
def test_methods_train_with_clients_as_domains(pacs_store, tmp_path, method, monkeypatch):
    from fedfeat.store.featurestore import FeatureStore

    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    st = FeatureStore.open(pacs_store)
    extra = {"promptfl": ["--set", "n_ctx=2"], "fedtpg": ["--set", "n_ctx=2"]}.get(method, [])
    r = run_cli(["train", "--store", pacs_store, "--method", method, "--partition", "domain", "--clients", 4,
                 "--participation", 1.0, "--rounds", 1, "--local-test", "joint", "--out", tmp_path / "runs",
                 "--set", "local_epochs=1", *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = next((tmp_path / "runs").glob("*/summary.json")).parent
    part = json.loads((run / "partition.json").read_text())
    assert part["params"]["client_domains"] == ["art_painting", "cartoon", "photo", "sketch"]
    dom = st.domains("train")
    assert [len(c) for c in part["clients"]] == [int((dom == d).sum()) for d in range(4)]
    s = json.loads((run / "summary.json").read_text())
    assert s["local_acc"] is not None and 0 <= s["final_acc"] <= 100
    # each client's personal test is its domain's test rows: the mean client accuracy is the mean domain accuracy,
    # and the global accuracy the domains' test-size-weighted mean
    acc = s["domain_acc"]
    assert list(acc) == ["art_painting", "cartoon", "photo", "sketch"]
    assert s["local_acc"] == pytest.approx(np.mean(list(acc.values())), abs=1e-9)
    n = np.bincount(st.domains("test"), minlength=4)
    assert s["final_acc"] == pytest.approx(float(np.dot(n, list(acc.values())) / n.sum()), abs=1e-9)
    # the personal accuracy per domain (each domain's one client, its own test rows): one global model here, so
    # each equals the domain's accuracy
    assert s["domain_local_acc"] == pytest.approx(acc)


def test_held_out_domain_is_the_test_set(pacs_store, tmp_path, monkeypatch):
    from fedfeat.store.featurestore import FeatureStore

    st = FeatureStore.open(pacs_store)
    r = run_cli(["train", "--store", pacs_store, "--method", "fedavg", "--partition", "domain", "--held-out",
                 "sketch", "--clients", 3, "--participation", 1.0, "--rounds", 1, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    s = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert s["partition"].endswith("-hosketch")
    acc = s["domain_acc"]
    assert [k for k, v in acc.items() if v is not None] == ["sketch"] and s["final_acc"] == pytest.approx(
        acc["sketch"]
    )
    part = json.loads(next((tmp_path / "runs").glob("*/partition.json")).read_text())
    assert part["params"]["client_domains"] == ["art_painting", "cartoon", "photo"]
    assert part["params"]["test_rows"] == np.flatnonzero(st.domains("test") == 3).tolist()
    r = run_cli(["train", "--store", pacs_store, "--method", "fedavg", "--partition", "domain", "--held-out",
                 "sketch", "--clients", 3, "--rounds", 1, "--local-test", "joint", "--out", tmp_path / "r2"])  # fmt: skip
    assert r.exit_code != 0 and "drop --local-test" in r.output
    # FedCLIP tests the whole target domain (every split of it): held_out_eval = all
    r = run_cli(["train", "--store", pacs_store, "--method", "fedavg", "--partition", "domain", "--held-out",
                 "sketch", "--held-out-eval", "all", "--clients", 3, "--rounds", 1, "--out", tmp_path / "r3"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = next((tmp_path / "r3").glob("*/summary.json")).parent
    conf = np.load(run / "results.npz")["confusion"]
    whole = sum(int(((st.domains(sp) == 3) & (st.labels(sp) >= 0)).sum()) for sp in st.splits)
    assert conf.sum() == whole > int((st.domains("test") == 3).sum())  # more rows than its test split alone
    assert json.loads((run / "summary.json").read_text())["partition"].endswith("-hosketch-heall")


@pytest.mark.parametrize("method", ["fedavg", "fedclip", "promptfl", "fedtpg"])
@pytest.mark.parametrize("setting", ["few-shot pathological", "base-to-novel"])
def test_methods_train_few_shot_pathological_and_base_to_novel(
    pacs_store, tmp_path, method, setting, monkeypatch
):
    monkeypatch.setenv("FEDFEAT_CACHE_DIR", str(tmp_path / "cache"))
    extra = ["--set", "n_ctx=2"] if method in ("promptfl", "fedtpg") else []
    part = (["--partition", "pathological", "--classes-per-client", 2, "--clients", 3, "--client-shots", 2]
            if setting == "few-shot pathological" else ["--partition", "iid", "--clients", 2, "--base-novel"])  # fmt: skip
    r = run_cli(["train", "--store", pacs_store, "--method", method, *part, "--participation", 1.0, "--rounds", 1,
                 "--set", "local_epochs=1", *extra, "--out", tmp_path / "runs"])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = next((tmp_path / "runs").glob("*/summary.json")).parent
    p = json.loads((run / "partition.json").read_text())
    s = json.loads((run / "summary.json").read_text())
    from fedfeat.store.featurestore import FeatureStore

    y = FeatureStore.open(pacs_store).labels("train")
    if setting == "few-shot pathological":
        assert p["params"]["client_shots"] == 2
        assert all(np.bincount(y[c]).max() <= 2 and len(set(y[c])) <= 2 for c in p["clients"])
    else:  # the fixture's 3 classes: the first ceil(3 / 2) = 2 are base
        assert p["params"]["novel_classes"] == [2]
        assert set(y[np.concatenate(p["clients"])]) == {0, 1}
        assert s["base_acc"] is not None and s["hm"] is not None
