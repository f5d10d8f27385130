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


def fedtpg_reference(
    dataset_classes: list[list], data_cnames: list[list], num_class_per_client: int, k: int, seed: int
) -> list[list]:
    """boschresearch/FedTPG @ f141c29 federated/server.py:97-132 ``init_server`` (the client class lists) and
    dataloader/dm_federated.py:33-60 ``ClassSampler`` (each client's k shots per class), transcribed with python's
    global ``random`` as the code uses it (state restored after). ``dataset_classes``: each dataset's (base) class
    labels in order; ``data_cnames``: each dataset's train items' class labels in dataset order. Returns each
    client's sampled item positions within its dataset, and the dataset of each client."""
    import random as R

    state = R.getstate()
    try:
        out, owner = [], []
        client_id, last_num_clients = 0, 0
        for di, cls in enumerate(dataset_classes):
            m = len(cls)
            all_cls_idx = np.arange(m)
            num_client_dataset = np.around(m / num_class_per_client).astype(int)
            if num_client_dataset == 0:
                num_client_dataset = 1
            current_num_clients = last_num_clients + num_client_dataset
            while client_id < current_num_clients:
                if client_id == current_num_clients - 1:
                    available_cls = all_cls_idx[(client_id - last_num_clients) * num_class_per_client :]
                else:
                    available_cls = all_cls_idx[(client_id - last_num_clients) * num_class_per_client :
                                                (client_id - last_num_clients + 1) * num_class_per_client]  # fmt: skip
                classes = [cls[i] for i in available_cls]
                R.seed(seed)  # ClassSampler._create_class_to_indices
                idx = []
                for c in classes:
                    valid_idx = np.where(np.array(data_cnames[di]) == c)[0].tolist()
                    try:
                        sample_idx = R.sample(valid_idx, k)
                    except ValueError:
                        sample_idx = valid_idx
                    idx += sample_idx
                out.append(idx)
                owner.append(di)
                client_id += 1
            last_num_clients = current_num_clients
        return out, owner
    finally:
        R.setstate(state)


def test_class_blocks_equal_fedtpgs_clients_and_shots():
    """Two datasets of 45 and 30 classes (a combined store), base-to-novel (the first ceil(n/2) of each): FedTPG's
    blocks of 10 and 8 shots per class, item for item."""
    rng = np.random.default_rng(3)
    n = (45, 30)
    y = [rng.integers(0, k, 400) for k in n]  # each dataset's labels in its own ids, dataset order
    y[1][:5] = 29  # a class with few images: all of them (the code's except branch)
    y[1] = np.where((y[1] == 14) & (np.arange(400) > 5), 13, y[1])  # class 14: its 0..? images
    labels = np.concatenate([y[0], 45 + y[1]])
    domains = np.concatenate([np.zeros(400, int), np.ones(400, int)])
    groups = [list(range(45)), list(range(45, 75))]
    p = make_partition(labels, "class-blocks", clients=4, block_classes=10, shots=8, seed=43, domains=domains,
                       domain_names=("sun", "dtd"), base_novel=True, class_groups=groups)  # fmt: skip
    base = [list(range(math.ceil(k / 2))) for k in n]  # FedTPG: m = ceil(n / 2) base labels of each dataset
    ref, owner = fedtpg_reference(base, [list(v) for v in y], 10, 8, 43)
    assert len(p.clients) == len(ref) == 4 and p.params["client_domains"] == ["sun", "sun", "dtd", "dtd"]
    for c, r, o in zip(p.clients, ref, owner):
        start = 0 if o == 0 else 400
        assert c.tolist() == [start + i for i in r]
    assert p.params["novel_classes"] == list(range(23, 45)) + list(range(60, 75))
    assert partition_key(p) == "b2n+class-blocks-b10-shot8-c4-s43"
