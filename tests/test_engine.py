"""The batched engine against the loop engine, and hand-checkable cases of every method's numbers."""

import math

import numpy as np
import pytest
import torch

from fedfeat.engine.context import Batch, LabelAccessError, sample_clients
from fedfeat.engine.data import load_run_data
from fedfeat.engine.optim import BatchedSGD
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import get_method
from fedfeat.methods.base import REGISTRY
from fedfeat.methods.fst_cbdg import balanced_counts, soft_label_update
from fedfeat.methods.linear import ntd_loss
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """CIFAR-10-like toy store: 10 classes x 100 train, D = 32; Dirichlet alpha 0.1 over 20 ragged clients."""
    p = SynthParams(classes=10, dim=32, train_per_class=100, test_per_class=20, templates=2)
    st = write_synthetic_store(tmp_path_factory.mktemp("e") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "dirichlet", clients=20, alpha=0.1, seed=1)
    sizes = part.sizes()
    assert sizes.min() < 16 <= sizes.max()  # ragged: some clients have fewer samples than one batch
    return st, part


CASES = [
    ("zeroshot", {}),
    ("centralized", {"batch_size": "16"}),
    ("fedavg", {"batch_size": "16", "local_epochs": "2"}),
    ("fedprox", {"batch_size": "16", "mu": "0.5"}),
    ("fedavgm", {"batch_size": "16"}),
    ("fedntd", {"batch_size": "16", "logit_scale": "10"}),
    ("fst-cbdg", {"batch_size": "16", "local_epochs": "2"}),
    ("fst-cbdg", {"batch_size": "16", "gamma": "1", "logit_scale": "100", "renormalize_synthetic": "true"}),
    ("fst-cbdg", {"batch_size": "16", "self_training": "false"}),
    ("fst-cbdg", {"batch_size": "16", "sampling": "false"}),
    ("fst-cbdg", {"batch_size": "16", "balance": "equal"}),
]


def _run(small, name, sets, engine, rounds=3, participation=0.5, seed=0, dtype=torch.float32, kernel="auto"):
    st, part = small
    m = get_method(name, sets)
    data = load_run_data(st, part, centralized=getattr(m, "centralized", False), dtype=dtype)
    return run_federated(
        m, data, rounds=rounds, participation=participation, seed=seed, engine=engine, kernel=kernel
    )


@pytest.mark.parametrize("name, sets", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_batched_equals_loop(small, name, sets):
    # logits x100 amplify float32 rounding differences between matmuls of different shapes chaotically
    # (~3e-4 after 3 rounds, while the two engines agree to 1e-12 in float64): check those cases in float64
    dtype = torch.float64 if float(sets.get("logit_scale", 1)) > 10 else torch.float32
    gl, ml = _run(small, name, sets, "loop", dtype=dtype)
    kernels = ["torch", "fused"] if get_method(name, sets).has_fused() else ["torch"]
    for kernel in kernels:  # the batched tensor program and, where a method has one, its fused CPU kernel
        gb, mb = _run(small, name, sets, "batched", dtype=dtype, kernel=kernel)
        _check_same(name, gb, mb, gl, ml)
        if REGISTRY[name].federated:
            np.testing.assert_allclose(
                [r["train_loss"] for r in mb[1:]], [r["train_loss"] for r in ml[1:]], rtol=1e-5
            )


def _check_same(name, gb, mb, gl, ml):
    assert [r["round"] for r in mb] == [r["round"] for r in ml]
    np.testing.assert_allclose([r["test_acc"] for r in mb], [r["test_acc"] for r in ml], atol=1e-5)
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    if REGISTRY[name].federated:
        assert len(mb) == 4
        assert mb[1]["bytes_up"] > 0 and mb[1]["train_loss"] is not None
    for a, b in zip(mb[1:], ml[1:]):
        if a.get("pseudo_label_acc") is not None:
            assert a["pseudo_label_acc"] == pytest.approx(b["pseudo_label_acc"], abs=1e-9)


def test_fused_kernels_cover_the_linear_heads_and_fst_cbdg():
    fused = {n for n, cls in REGISTRY.items() if get_method(n).has_fused()}
    # creff / clip2fl subclass a linear head but change the loss: they must not inherit its kernel
    # copl-linear is FedAvg on its own pseudo-labels: FedAvg's loss, so FedAvg's kernel
    # fednova / fedavg-tau-norm train with FedAvg's (FedProx's) local loss: they change only the server / evaluation
    assert fused == {"fedavg", "centralized", "fedprox", "fedavgm", "fedntd", "fst-cbdg", "copl-linear"} | {
        "fednova",
        "fedavg-tau-norm",
        "feddf",
        "fedbe",
        "ccvr",  # FedAvg's local loss; server-side steps only
    } | {"fedadagrad", "fedadam", "fedyogi"}  # FedAvg's clients, an adaptive server step (methods.serveropt)


def test_fused_kernel_hand_step():
    """One client, one step of two samples, K = D = 2, W = 0, b = 0, lr 0.1, no momentum / decay:
    x = (1, 0) label 0 and x = (0, 1) label 1; softmax(0) = (1/2, 1/2), so the mean logit gradients are
    (-1/4, 1/4) and (1/4, -1/4): gW = [[-1/4, 1/4], [1/4, -1/4]], gb = 0; W = -0.1 gW; loss = log 2."""
    from fedfeat.engine import kernels

    feats = np.eye(2, dtype=np.float32)
    labels = np.array([0, 1])
    starts, sizes = np.array([0]), np.array([2])  # one client of two samples, one batch of 2
    W = np.zeros((1, 2, 2), np.float32)
    b = np.zeros((1, 2), np.float32)
    loss = np.zeros((1, 1))
    kernels.linear_epoch(
        feats, labels, starts, sizes, 2, 12345, W, b, np.zeros_like(W), np.zeros_like(b), W[0].copy(), b[0].copy(),
        lr=0.1, momentum=0.0, weight_decay=0.0, logit_scale=1.0, loss_out=loss, threads=1,
    )  # fmt: skip
    np.testing.assert_allclose(W[0], [[0.025, -0.025], [-0.025, 0.025]], atol=1e-7)
    np.testing.assert_allclose(b, 0, atol=1e-7)
    assert loss[0, 0] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("K", [3, 5])
def test_fused_kernel_equals_numpy_sgd_for_every_block_shape(K):
    """The fused kernel against a plain numpy SGD in float64, on clients whose steps end in blocks of 1, 2 and 3
    samples (batch 6 = a block of four + a pair; last batches of 1..5) and an odd number of classes (the kernels'
    paired rows then pair the last row with itself), D = 13 (not a multiple of the vector width)."""
    from fedfeat.engine import kernels

    rs = np.random.default_rng(7)
    D, B, lr, mom, wd, scale = 13, 6, 0.3, 0.9, 1e-3, 2.0
    sizes = np.array([1, 2, 3, 5, 6, 7, 9, 11, 16])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    feats = rs.standard_normal((int(sizes.sum()), D))
    labels = rs.integers(0, K, feats.shape[0])
    Wg, bg = rs.standard_normal((K, D)) * 0.3, rs.standard_normal(K) * 0.3
    W, b = np.zeros((len(sizes), K, D)), np.zeros((len(sizes), K))
    loss = np.zeros((3, len(sizes)))
    key = 987654321
    kernels.linear_epoch(
        feats, labels, starts, sizes, B, key, W, b, np.zeros_like(W), np.zeros_like(b), Wg, bg, lr=lr,
        momentum=mom, weight_decay=wd, logit_scale=scale, loss_out=loss, threads=2, init=True, one_epoch=True,
    )  # fmt: skip
    for j, (st, n) in enumerate(zip(starts, sizes)):
        # the kernel's shuffle (tested against the engine's)
        order = kernels._client_rows(np.uint64(key), st, n)
        w, c, mw, mc = Wg.copy(), bg.copy(), np.zeros_like(Wg), np.zeros_like(bg)
        for s in range(-(-n // B)):
            rows = order[s * B : (s + 1) * B]
            x, y = feats[rows], labels[rows]
            z = scale * (x @ w.T + c)
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            ref_loss = -np.log(p[np.arange(len(y)), y]).mean()
            p[np.arange(len(y)), y] -= 1
            g = scale * p / len(y)
            mw, mc = mom * mw + (g.T @ x + wd * w), mom * mc + (g.sum(0) + wd * c)
            w, c = w - lr * mw, c - lr * mc
            assert loss[s, j] == pytest.approx(ref_loss, rel=1e-12)
        np.testing.assert_allclose(W[j], w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(b[j], c, rtol=0, atol=1e-12)


def test_kernel_choice(small):
    from fedfeat.engine.rounds import resolve_kernel
    from fedfeat.errors import FedfeatError

    cpu = torch.device("cpu")
    assert resolve_kernel("auto", get_method("fedavg"), "batched", cpu) == "fused"
    assert resolve_kernel("auto", get_method("fedavg"), "loop", cpu) == "torch"
    assert resolve_kernel("auto", get_method("zeroshot"), "batched", cpu) == "torch"
    assert resolve_kernel("auto", get_method("fedavg"), "batched", torch.device("cuda")) == "torch"
    with pytest.raises(FedfeatError, match="has no fused kernel"):
        resolve_kernel("fused", get_method("creff"), "batched", cpu)
    with pytest.raises(FedfeatError, match="loop engine"):
        resolve_kernel("fused", get_method("fedavg"), "loop", cpu)
    with pytest.raises(FedfeatError, match="unknown kernel"):
        resolve_kernel("fast", get_method("fedavg"), "batched", cpu)


def test_fused_run_gives_torch_its_threads_back(small):
    """A fused run puts torch on one thread (the kernels own the cores) and restores it, even on error."""
    data = load_run_data(*small)
    before = torch.get_num_threads()
    seen = []
    run_federated(
        get_method("fedavg"), data, rounds=1, participation=0.5, seed=0, kernel="fused",
        on_round=lambda row: seen.append(torch.get_num_threads()),
    )  # fmt: skip
    assert seen == [1, 1] and torch.get_num_threads() == before
    with pytest.raises(ZeroDivisionError):
        run_federated(get_method("fedavg"), data, rounds=1, participation=0.5, seed=0, kernel="fused",
                      on_round=lambda row: 1 / 0)  # fmt: skip
    assert torch.get_num_threads() == before


def test_training_changes_the_head(small):
    g0, m0 = _run(small, "fedavg", {"batch_size": "16"}, "batched", rounds=0)
    g1, _ = _run(small, "fedavg", {"batch_size": "16"}, "batched", rounds=1)
    assert len(m0) == 1 and not torch.allclose(g0["W"], g1["W"])


def test_same_seed_same_numbers_different_seed_different(small):
    _, a = _run(small, "fst-cbdg", {"batch_size": "16"}, "batched", seed=3)
    _, b = _run(small, "fst-cbdg", {"batch_size": "16"}, "batched", seed=3)
    _, c = _run(small, "fst-cbdg", {"batch_size": "16"}, "batched", seed=4)
    assert [r["test_acc"] for r in a] == [r["test_acc"] for r in b]
    assert [r["clients"] for r in a] != [r["clients"] for r in c]


def test_zeroshot_equals_hand_argmax(small):
    st, part = small
    _, m = _run(small, "zeroshot", {}, "batched")
    x = st.features("test").astype(np.float32)
    t = st.text_features()[0].astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    hand = 100 * np.mean((x @ t.T).argmax(1) == st.labels("test"))
    assert m[0]["test_acc"] == pytest.approx(hand, abs=1e-9)
    assert len(m) == 1  # no rounds for a method that does not train


def test_ntd_loss_hand_case():
    """z_local = [2, 1, 0], z_global = [0, 1, 2], y = 0, tau = 1, beta = 1:
    CE = log(e^2 + e + 1) - 2; not-true logits: local [1, 0], global [1, 2];
    KL(p_g || p_l) = sum p_g (log p_g - log p_l) with p = softmax over the two not-true classes."""
    zl = torch.tensor([[[2.0, 1.0, 0.0]]])
    zg = torch.tensor([[[0.0, 1.0, 2.0]]])
    y = torch.tensor([[0]])
    mask = torch.tensor([[True]])
    ce = math.log(math.e**2 + math.e + 1) - 2
    pl = [math.e / (math.e + 1), 1 / (math.e + 1)]
    pg = [math.e / (math.e + math.e**2), math.e**2 / (math.e + math.e**2)]
    kl = sum(g * (math.log(g) - math.log(l)) for g, l in zip(pg, pl))
    got = ntd_loss(zl, zg, y, mask, tau=1.0, beta=1.0)
    assert got.item() == pytest.approx(ce + kl, abs=1e-6)
    # tau = 2, beta = 0.5: the KL term is computed on halved logits and scaled by beta tau^2 = 2
    pl2 = torch.softmax(torch.tensor([0.5, 0.0]), 0)
    pg2 = torch.softmax(torch.tensor([0.5, 1.0]), 0)
    kl2 = float((pg2 * (pg2.log() - pl2.log())).sum())
    assert ntd_loss(zl, zg, y, mask, tau=2.0, beta=0.5).item() == pytest.approx(ce + 2 * kl2, abs=1e-6)


def test_fst_balanced_counts():
    assert balanced_counts(torch.tensor([[5, 2, 0]]), 0.0).tolist() == [[0, 3, 5]]
    assert balanced_counts(torch.tensor([[5, 2, 0]]), 1.0).tolist() == [[5, 8, 10]]


def test_fst_soft_label_update_after_one_step(tmp_path):
    """One client, one sample, one step, no synthetic samples: after the step the stored soft label is
    beta q0 + (1 - beta) softmax(s W0 x) with q0 = softmax(s W0 x) -- here with beta = 0.3 and a hand-set q0
    different from the zero-shot softmax, so the update is visible."""
    p = SynthParams(classes=3, dim=8, train_per_class=1, test_per_class=1, templates=1)
    st = write_synthetic_store(tmp_path / "t.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "iid", clients=1, seed=0)
    m = get_method("fst-cbdg", {"beta": "0.3", "sampling": "false", "batch_size": "3"})
    data = load_run_data(st, part)
    q0 = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]])
    orig_setup = m.setup

    def setup(ctx):
        orig_setup(ctx)
        ctx.state["q"] = q0.clone()

    m.setup = setup
    x = torch.nn.functional.normalize(data.train_x.float(), dim=1)
    t = torch.nn.functional.normalize(data.text_all[0], dim=1)
    f = torch.softmax(x @ t.T, dim=1)  # the initial head's prediction (logit scale 1)
    captured = {}
    m.local_end = lambda ctx, plan, local, params: captured.setdefault("q", ctx.state["q"].clone())
    run_federated(m, data, rounds=1, participation=1.0, seed=0)
    torch.testing.assert_close(captured["q"], soft_label_update(q0, f, 0.3), atol=1e-6, rtol=0)
    torch.testing.assert_close(captured["q"], 0.3 * q0 + 0.7 * f, atol=1e-6, rtol=0)


def test_label_free_methods_cannot_read_labels(small):
    st, part = small
    data = load_run_data(st, part)
    for name, cls in REGISTRY.items():
        if not cls.uses_labels and not getattr(
            cls, "needs_live_text", False
        ):  # (live ones: test_prompt, fedcopl)
            m = get_method(name)
            from fedfeat.engine.data import build_context

            assert build_context(data, m, 0, torch.device("cpu")).labels is None, name
    b = Batch(
        torch.zeros(1, 2, 3), torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.long), 1, 0, 0
    )
    with pytest.raises(LabelAccessError):
        _ = b.y

    class Cheater(REGISTRY["fst-cbdg"]):
        def step_loss(self, ctx, params, batch, local):
            _ = batch.y
            return super().step_loss(ctx, params, batch, local)

    with pytest.raises(LabelAccessError):
        run_federated(Cheater(get_method("fst-cbdg").p), data, rounds=1, participation=0.2, seed=0)


def test_batched_sgd_equals_torch_sgd():
    torch.manual_seed(0)
    W0 = torch.randn(3, 4)
    x = torch.randn(5, 4)
    y = torch.tensor([0, 1, 2, 1, 0])
    ref = W0.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01)
    params = {"W": W0.clone().unsqueeze(0).repeat(2, 1, 1)}
    bopt = BatchedSGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    bopt.reset(params)
    for _step in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(x @ ref.T, y).backward()
        opt.step()
        p = params["W"][:1].detach().requires_grad_(True)
        (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(x @ p[0].T, y), [p])
        bopt.step(params, {"W": g}, n=1)  # client 1 never steps: it must stay at W0
    torch.testing.assert_close(params["W"][0], ref.detach(), atol=1e-6, rtol=0)
    assert torch.equal(params["W"][1], W0)


def test_client_sampling_follows_fedntd_count():
    assert len(sample_clients(0, 1, 100, 0.1)) == 10
    assert len(sample_clients(0, 1, 20, 0.4)) == 8
    assert len(sample_clients(0, 1, 5, 0.01)) == 1  # max(1, int(p * n))
    a = sample_clients(0, 1, 100, 0.1)
    assert len(set(a.tolist())) == 10 and not np.array_equal(a, sample_clients(0, 2, 100, 0.1))


def test_unknown_method_and_key():
    from fedfeat.errors import FedfeatError

    with pytest.raises(FedfeatError, match="fedavg"):
        get_method("nope")
    with pytest.raises(FedfeatError, match="valid keys: .*beta"):
        get_method("fst-cbdg", {"betta": "1"})


def test_stream_keys_are_the_tensor_hash():
    """``stream_key`` hashes python ints without tensors; it must stay bit for bit the int64 tensor hash
    (every shuffle and draw of every run depends on it): pinned values and a check against ``_mix``."""
    from fedfeat.engine import rng

    assert rng.stream_key(0, 1, 2, 3) == 1901318328662684678
    from fedfeat.engine import kernels  # the fused kernels hash sample positions themselves: the same keys

    pos = torch.tensor([0, 1, 7, 49_999, 2**40 + 3])
    key = rng.stream_key(5, 6, 0, rng.TAG_SHUFFLE)
    assert [kernels._uniform_key(np.uint64(key), int(p)) for p in pos] == rng.uniform_keys(key, pos).tolist()
    assert rng.stream_key(19940817, 7, 0, 5) == 8571754631293477877
    vals = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789012345, -987654321], dtype=torch.int64)
    for v, t in zip(vals.tolist(), rng._mix(vals).tolist()):
        u = rng._mix_u64(v & rng._M64)
        assert (u - (1 << 64) if u >> 63 else u) == t


@pytest.mark.parametrize("D", [12, 1000, 1024])
def test_fst_noise_bank_rows_do_not_depend_on_how_many_are_drawn(D):
    """A step's bank is drawn only as far as needed (``bank_rows``); its rows must equal those of the whole
    64-row blocks, whatever P, or the batched engine (P = most of any client) and the loop (P of one client)
    would draw different noise."""
    from types import SimpleNamespace

    from fedfeat.methods.fst_cbdg import BANK_BLOCK, bank_rows

    m = get_method("fst-cbdg")
    ctx = SimpleNamespace(seed=3, D=D, device=torch.device("cpu"), text=torch.zeros(1, D))
    whole = m._noise(ctx, 2, 0, 1, 2 * BANK_BLOCK)
    for P in (1, 3, 5, 63, 64, 65, 70, 127):
        assert bank_rows(P, D) >= P and (bank_rows(P, D) * D) % 16 == 0 or bank_rows(P, D) % BANK_BLOCK == 0
        assert torch.equal(m._noise(ctx, 2, 0, 1, P), whole[:P]), P
    assert not torch.equal(m._noise(ctx, 2, 0, 2, 5), whole[:5])  # another step, other noise


def test_kernel_exp_and_argmax_counts():
    from fedfeat.engine import kernels

    @kernels.nb.njit
    def vexp(x, out):
        for i in range(x.shape[0]):
            out[i] = kernels._exp(x[i])

    x = np.concatenate([np.linspace(-700, 700, 20001), [-1e-300, 0.0, 1e-300, -0.5 * math.log(2)]])
    out = np.empty_like(x)
    vexp(x, out)
    np.testing.assert_allclose(out, np.exp(x), rtol=1e-15, atol=0)  # within ~4 ulp
    x32 = np.linspace(-90, 0, 10001, dtype=np.float32)
    out32 = np.empty_like(x32)
    vexp(x32, out32)
    assert np.array_equal(out32, np.exp(x32.astype(np.float64)).astype(np.float32))  # correctly rounded
    q = np.array([[0.1, 0.5, 0.5], [0.9, 0.0, 0.1], [0.2, 0.2, 0.6], [0.3, 0.3, 0.3], [0, 1, 0]], np.float32)
    counts = kernels.argmax_counts(q, np.array([0, 3]), np.array([3, 2]))
    assert counts.tolist() == [[1, 1, 1], [1, 1, 0]]  # ties go to the first maximum, as torch.argmax


def test_kernel_stable_argsort_keeps_ties_in_index_order():
    """The fused kernels' shuffles and synthetic orders must equal the torch path's stable sorts exactly,
    also in the (astronomically rare) case of equal keys."""
    from fedfeat.engine import kernels

    rs = np.random.default_rng(3)
    for n, hi in ((1, 5), (7, 3), (500, 40), (500, 2**62), (1000, 2)):
        k = rs.integers(0, hi, n).astype(np.int64)
        assert np.array_equal(kernels._stable_argsort(k), np.argsort(k, kind="stable")), (n, hi)


# Every cached-feature method of the registry that CASES does not list, at its defaults (a small batch, short server
# loops): batched = loop without an edit here when a method is added. Those that need other data say where their
# equivalence is tested.
ELSEWHERE = {
    "fed-mp": "an open-vocabulary split; tests/test_fedmp.py",
    "fedclip": "an open-vocabulary adapter; tests/test_fedmp.py",
    "feddf": "a server set and a validation set apart from the clients'; tests/test_baselines_server.py",
}
# creff / clip2fl's server loops, small; the server-set methods' server data: the training split (the small store's
# partition leaves no row unassigned)
SHORT = {
    "match_steps": "3",
    "crt_epochs": "3",
    "num_of_feature": "5",
    "server_data": "train",
    "val_data": "train",
}


def _registry_cases():
    listed = {n for n, _ in CASES}
    for name, cls in REGISTRY.items():
        if cls.runs_on == "cache" and cls.federated and name not in listed and name not in ELSEWHERE:
            yield name


@pytest.mark.parametrize("name", sorted(_registry_cases()))
def test_every_cached_feature_method_batched_equals_loop(small, name):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(get_method(name).Params)}
    sets = {k: v for k, v in {"batch_size": "16", **SHORT}.items() if k in fields}
    test_batched_equals_loop(small, name, sets)
