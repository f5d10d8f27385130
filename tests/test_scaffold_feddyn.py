"""SCAFFOLD and FedDyn on the linear head (``fedfeat.methods.scaffold``, ``fedfeat.methods.feddyn``).

* **Transcriptions of FL-bench** (``KarhouTam/FL-bench@06e658bca5af6ce732e25bb7c0f8be321e14a85e``): the client and
  server arithmetic of ``src/client/scaffold.py`` / ``src/server/scaffold.py`` and ``src/client/feddyn.py`` /
  ``src/server/feddyn.py`` (with ``FedAvgServer.aggregate_client_updates``), written here per client with
  ``torch.optim.SGD``, ``param.grad += c - c_i`` and ``torch.nn.utils.clip_grad_norm_`` as FL-bench writes them, on
  the engine's mini-batches (the same counter-based shuffles; no batch of one sample, which FL-bench would skip), 3
  rounds, half the clients a round, in float64: the engine's head and every client's state equal it.
* **Batched = loop engine**, state included; **a checkpoint resumed = the run uninterrupted**, state included.
* **Hand-checkable**: one full-batch step per client makes SCAFFOLD's new ``c_i`` the client's gradient at ``x``;
  ``c`` is always the mean of all ``N`` clients' ``c_i``; ``ClippedSGD`` is ``clip_grad_norm_`` + ``torch.optim.SGD``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers_clip import run_cli

from fedfeat.engine import checkpoint
from fedfeat.engine.context import epoch_tables, make_plan, sample_clients
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, get_method
from fedfeat.methods.base import method_table
from fedfeat.methods.feddyn import ClippedSGD
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

ROUNDS, PART, SEED = 3, 0.5, 2
B = 5  # batch size: no client's last batch holds one sample (asserted), so FL-bench's `len(x) <= 1` skip is moot


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    p = SynthParams(classes=5, dim=12, train_per_class=16, test_per_class=6, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("scf") / "s.zarr", p, stats=False, log=lambda *_: None)
    part = make_partition(st.labels("train"), "dirichlet", clients=6, alpha=0.5, seed=1)
    sizes = part.sizes()
    assert (
        all(n % B != 1 for n in sizes) and len(set((sizes + B - 1) // B)) > 1
    )  # ragged steps, no 1-sample batch
    return st, part


@pytest.fixture(scope="module")
def data64(store):
    return load_run_data(*store, dtype=torch.float64)


@pytest.fixture(scope="module")
def data32(store):
    return load_run_data(*store)


def _spy(name: str, sets: dict):
    """The registered method with its ``ctx`` kept (to read ``ctx.state`` after the run)."""
    cls = REGISTRY[name]

    def setup(self, ctx):
        cls.setup(self, ctx)
        self.ctx = ctx

    return type(f"Spy{cls.__name__}", (cls,), {"setup": setup})(get_method(name, sets).p)


def _dense(table: dict, n: int) -> dict[str, torch.Tensor]:
    """A per-client table (``{"ids": [V], name: [V, ...]}``: the clients sampled so far) as ``{name: [n, ...]}``."""
    out = {}
    for k, v in table.items():
        if k != "ids":
            out[k] = torch.zeros((n, *v.shape[1:]), dtype=v.dtype).index_copy_(0, table["ids"], v)
    return out


def _seen(rows) -> list[int]:
    """The clients sampled in a run's rounds, sorted: what a per-client table holds."""
    return sorted({c for r in rows[1:] for c in r["clients"]})


def _run(name, sets, data, engine="batched", rounds=ROUNDS, **kw):
    m = _spy(name, sets)
    glob, rows = run_federated(m, data, rounds=rounds, participation=PART, seed=SEED, engine=engine, kernel="torch",
                               **kw)  # fmt: skip
    return glob, m.ctx.state, rows


# ---------------------------------------------------------------------------------- FL-bench, transcribed
def _rounds(data, method, rounds):
    """The engine's data as FL-bench's clients would read it: per round, the sampled clients in ascending id, each
    with its list of mini-batches ``(x, y)`` (epoch after epoch) -- the engine's shuffles (``epoch_tables``)."""
    ctx = build_context(data, method, SEED, torch.device("cpu"))
    p = method.p
    out = []
    for rnd in range(1, rounds + 1):
        plan = make_plan(
            ctx, rnd, sample_clients(SEED, rnd, ctx.n_clients, PART), p.batch_size, p.local_epochs
        )
        batches = {int(c): [] for c in plan.clients}
        for e in range(p.local_epochs):
            idx, mask = epoch_tables(ctx, plan, e)
            for s in range(idx.shape[0]):
                for j, c in enumerate(plan.clients.tolist()):
                    rows = idx[s, j][mask[s, j]]
                    if len(rows):
                        batches[c].append((ctx.feats[rows], ctx.labels[rows]))
        sizes = {int(c): int(n) for c, n in zip(plan.clients, plan.sizes)}
        out.append((rnd, sorted(batches), batches, sizes))
    return ctx, out


def _sgd(p, params, rnd, extra_wd=0.0):
    lr = p.lr * p.lr_decay ** (rnd - 1)
    return lr, torch.optim.SGD(params, lr=lr, momentum=p.momentum, weight_decay=p.weight_decay + extra_wd)


def fl_bench_scaffold(data, sets, rounds=ROUNDS):
    """``src/client/scaffold.py`` (``fit``: ``param.grad.data += c - c_i`` before ``optimizer.step()``; ``train``:
    ``c_plus = c_i - c - y_delta / (K lr)``, ``c_delta = c_plus - c_i``) and ``src/server/scaffold.py``
    (``x += global_lr * sum(y_delta * 1/|S|)``, ``c += sum(c_delta) / client_num``); K = the client's steps."""
    m = get_method("scaffold", sets)
    p = m.p
    ctx, plan = _rounds(data, m, rounds)
    x = [ctx.text.clone(), torch.zeros(ctx.K, dtype=ctx.text.dtype)]  # public_model_params: W, b
    c_global = [torch.zeros_like(t) for t in x]
    c_local = [[torch.zeros_like(t) for t in x] for _ in range(ctx.n_clients)]
    for rnd, clients, batches, _ in plan:
        y_deltas, c_deltas = [], []
        for i in clients:
            W, b = (t.clone().requires_grad_(True) for t in x)
            lr, opt = _sgd(p, [W, b], rnd)
            for xb, yb in batches[i]:
                loss = F.cross_entropy(p.logit_scale * (xb @ W.T + b), yb)
                opt.zero_grad()
                loss.backward()
                for param, c, c_i in zip((W, b), c_global, c_local[i]):
                    param.grad.data += c - c_i
                opt.step()
            with torch.no_grad():
                y_delta = [W.detach() - x[0], b.detach() - x[1]]
                coef = 1 / (len(batches[i]) * lr)
                c_plus = [c_i - c - coef * yd for c, c_i, yd in zip(c_global, c_local[i], y_delta)]
                c_deltas.append([cp - cl for cp, cl in zip(c_plus, c_local[i])])
                c_local[i] = c_plus
                y_deltas.append(y_delta)
        weights = torch.ones(len(y_deltas), dtype=x[0].dtype) / len(y_deltas)
        for k in range(2):
            x[k] = x[k] + p.global_lr * torch.sum(torch.stack([d[k] for d in y_deltas], -1) * weights, -1)
            c_global[k] = c_global[k] + torch.stack([d[k] for d in c_deltas], -1).sum(-1) / ctx.n_clients
    return x, c_global, c_local


def fl_bench_feddyn(data, sets, rounds=ROUNDS):
    """``src/client/feddyn.py`` (``loss = CE + alpha * sum(theta * (nabla_i - theta_g))``, ``clip_grad_norm_``,
    ``optimizer.step()``; ``prox``: alpha in the weight decay, FL-Simulator ``client/feddyn.py:10``) and
    ``src/server/feddyn.py`` (``FedAvgServer``'s ``public -= sum(w_i * diff_i)`` with ``diff_i = theta_g - theta_i``
    and ``w_i = n_i / sum n``; ``nabla[i] -= diff_i``; ``public + nabla.mean(0)``). Returns the head, nabla and how
    many steps were clipped."""
    m = get_method("feddyn", sets)
    p = m.p
    ctx, plan = _rounds(data, m, rounds)
    g = [ctx.text.clone(), torch.zeros(ctx.K, dtype=ctx.text.dtype)]
    nabla = [[torch.zeros_like(t) for t in g] for _ in range(ctx.n_clients)]
    clipped = 0
    for rnd, clients, batches, sizes in plan:
        diffs, weights = {}, []
        for i in clients:
            delta = [nabla[i][k] - g[k] for k in range(2)]  # local_dual_correction
            W, b = (t.clone().requires_grad_(True) for t in g)
            _, opt = _sgd(p, [W, b], rnd, extra_wd=p.alpha if p.prox else 0.0)
            for xb, yb in batches[i]:
                if len(xb) <= 1:
                    continue
                loss_ce = F.cross_entropy(p.logit_scale * (xb @ W.T + b), yb)
                loss_correct = torch.sum(W * delta[0]) + torch.sum(b * delta[1])
                loss = loss_ce + p.alpha * loss_correct
                opt.zero_grad()
                loss.backward()
                if p.max_grad_norm:
                    clipped += bool(
                        torch.nn.utils.clip_grad_norm_([W, b], max_norm=p.max_grad_norm) > p.max_grad_norm
                    )
                opt.step()
            diffs[i] = [g[0] - W.detach(), g[1] - b.detach()]
            weights.append(sizes[i] if p.weights == "samples" else 1)
        w = torch.tensor(weights, dtype=g[0].dtype) / sum(weights)
        for k in range(2):
            g[k] = g[k] - torch.sum(torch.stack([diffs[i][k] for i in clients], -1) * w, -1)
        for i in clients:
            nabla[i] = [nabla[i][k] - diffs[i][k] for k in range(2)]
        g = [g[k] + torch.stack([nabla[i][k] for i in range(ctx.n_clients)]).mean(0) for k in range(2)]
    return g, nabla, clipped


SCAFFOLD_CASES = [
    {},  # the defaults: CLIP's logit scale, lr 1e-4, plain SGD
    {"lr": "0.05", "logit_scale": "1", "momentum": "0.9", "weight_decay": "0.01", "lr_decay": "0.5",
     "global_lr": "0.7", "local_epochs": "2"},  # momentum and weight decay act on g + c - c_i, as torch's SGD does
]  # fmt: skip
FEDDYN_CASES = [
    {},  # FL-bench's switches: samples weights, no alpha theta term, clipping at 10 (reached: logit scale 100)
    {"lr": "0.05", "logit_scale": "10", "momentum": "0.5", "weight_decay": "0.001", "prox": "true",
     "weights": "uniform", "max_grad_norm": "0.3", "alpha": "0.5", "local_epochs": "2"},  # the paper's, clipped
    {"lr": "0.05", "logit_scale": "1", "max_grad_norm": "0", "alpha": "0.01"},  # no clipping (the paper)
]  # fmt: skip


@pytest.mark.parametrize("sets", SCAFFOLD_CASES, ids=["defaults", "momentum-wd-decay"])
def test_scaffold_equals_fl_bench(data64, sets):
    sets = {**sets, "batch_size": str(B)}
    glob, state, rows = _run("scaffold", sets, data64)
    x, c, c_local = fl_bench_scaffold(data64, sets)
    dense = _dense(state["c_local"], len(c_local))
    for k, name in enumerate(("W", "b")):
        torch.testing.assert_close(glob[name], x[k], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(state["c"][name], c[k], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(
            dense[name], torch.stack([ci[k] for ci in c_local]), atol=1e-10, rtol=1e-10
        )
    assert state["c_local"]["ids"].tolist() == _seen(rows)  # the table holds the clients sampled so far
    assert state["c"]["W"].abs().max() > 0 and state["c_local"]["W"].abs().max() > 0
    assert [len(r["clients"]) for r in rows[1:]] == [3] * ROUNDS  # half of the 6 clients a round


@pytest.mark.parametrize("sets", FEDDYN_CASES, ids=["defaults", "paper-clipped", "unclipped"])
def test_feddyn_equals_fl_bench(data64, sets):
    sets = {**sets, "batch_size": str(B)}
    glob, state, rows = _run("feddyn", sets, data64)
    g, nabla, clipped = fl_bench_feddyn(data64, sets)
    dense = _dense(state["nabla"], len(nabla))
    for k, name in enumerate(("W", "b")):
        torch.testing.assert_close(glob[name], g[k], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(dense[name], torch.stack([n[k] for n in nabla]), atol=1e-10, rtol=1e-10)
    assert state["nabla"]["ids"].tolist() == _seen(rows)
    assert (clipped > 0) == (sets.get("max_grad_norm") != "0")  # the clipping is exercised where it is on
    assert state["nabla"]["W"].abs().max() > 0
    assert [len(r["clients"]) for r in rows[1:]] == [3] * ROUNDS  # half of the 6 clients a round


# ---------------------------------------------------------------------------------- engines, state, resume
@pytest.mark.parametrize(
    "name, sets",
    [("scaffold", SCAFFOLD_CASES[1]), ("feddyn", FEDDYN_CASES[1]), ("scaffold", {}), ("feddyn", {})],
)
def test_batched_equals_loop(data32, name, sets):
    """All sampled clients in one batched program = one client after another (``--engine loop``), float32."""
    sets = {**sets, "batch_size": "4"}
    gb, sb, rb = _run(name, sets, data32, "batched")
    gl, sl, rl = _run(name, sets, data32, "loop")
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    for key, tree in sb.items():
        for k in tree:
            torch.testing.assert_close(tree[k], sl[key][k], atol=1e-5, rtol=1e-5)
    assert [r["test_acc"] for r in rb] == pytest.approx([r["test_acc"] for r in rl], abs=1e-9)
    assert [r["train_loss"] for r in rb[1:]] == pytest.approx([r["train_loss"] for r in rl[1:]], rel=1e-5)


@pytest.mark.parametrize("name", ["scaffold", "feddyn"])
def test_resumed_from_a_checkpoint_equals_the_uninterrupted_run(data32, tmp_path, name):
    """Round 2's checkpoint written to disk (safetensors) and read back: rounds 3-4 give the uninterrupted run's
    head and state bit for bit (every sampled client's state is in the checkpoint, ids included)."""
    want, want_state, want_rows = _run(name, {}, data32, rounds=4)
    saved = {}

    def keep(rnd, glob, state):
        checkpoint.save(tmp_path / f"ck{rnd}.safetensors", rnd, glob, state)
        saved[rnd] = tmp_path / f"ck{rnd}.safetensors"

    _run(name, {}, data32, rounds=4, on_checkpoint=keep, checkpoint_every=2)
    got, got_state, got_rows = _run(name, {}, data32, rounds=4, resume=checkpoint.load(saved[2], "cpu"))
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for key in want_state:
        for k in want_state[key]:
            assert torch.equal(got_state[key][k], want_state[key][k]), (key, k)
    assert [r["test_acc"] for r in got_rows] == [r["test_acc"] for r in want_rows[3:]]


# ---------------------------------------------------------------------------------- hand-checkable
def test_scaffold_one_full_batch_step_makes_c_i_the_gradient(data64):
    """One step per client (batch = its whole data, plain SGD, ``c = c_i = 0`` in round 1): option II's
    ``c_i+ = (x - y_i) / (1 * lr)`` is the cross-entropy gradient at ``x`` on the client's data; ``c`` is their sum
    over the N clients; ``x+ = x - lr mean_i g_i``."""
    sets = {"batch_size": "1000", "lr": "0.1", "logit_scale": "10"}
    glob, state, _ = _run("scaffold", sets, data64, rounds=1)
    ctx = build_context(data64, get_method("scaffold", sets), SEED, torch.device("cpu"))
    clients = sample_clients(SEED, 1, ctx.n_clients, PART).tolist()
    grads = {}
    for i in clients:
        rows = slice(int(ctx.offsets[i]), int(ctx.offsets[i + 1]))
        W, b = (
            ctx.text.clone().requires_grad_(True),
            torch.zeros(ctx.K, dtype=ctx.text.dtype, requires_grad=True),
        )
        loss = F.cross_entropy(10.0 * (ctx.feats[rows] @ W.T + b), ctx.labels[rows])
        grads[i] = dict(zip("Wb", torch.autograd.grad(loss, [W, b])))
    assert state["c_local"]["ids"].tolist() == sorted(clients)
    dense = _dense(state["c_local"], ctx.n_clients)
    for k in ("W", "b"):
        for i in range(ctx.n_clients):
            want = grads[i][k] if i in grads else torch.zeros_like(dense[k][i])
            torch.testing.assert_close(dense[k][i], want, atol=1e-12, rtol=1e-9)
        mean_g = torch.stack([grads[i][k] for i in clients]).mean(0)
        torch.testing.assert_close(state["c"][k], sum(grads[i][k] for i in clients) / ctx.n_clients)
        x0 = ctx.text if k == "W" else torch.zeros_like(glob["b"])
        torch.testing.assert_close(glob[k], x0 - 0.1 * mean_g, atol=1e-12, rtol=1e-9)


def test_scaffold_c_is_the_mean_of_every_clients_c_i(data64):
    """``c = (1/N) sum_i c_i`` over all N clients after every round (Alg. 1: c starts at the mean of zeros and moves
    by ``(1/N) sum_S dc_i``)."""
    _, state, _ = _run("scaffold", SCAFFOLD_CASES[1], data64, rounds=4)
    dense = _dense(state["c_local"], 6)
    for k in ("W", "b"):
        torch.testing.assert_close(state["c"][k], dense[k].mean(0), atol=1e-12, rtol=1e-9)


def test_clipped_sgd_is_clip_grad_norm_then_torch_sgd():
    """Per client: ``clip_grad_norm_`` over its W and b gradients, then ``torch.optim.SGD`` (momentum, weight
    decay), two steps; client 2 of 3 drops out at the second step (the active prefix); clients 0 and 2 are clipped
    (norms 50 and 4 > 3), client 1 is not (norm 0.5)."""
    gen = torch.Generator().manual_seed(0)
    W0, b0 = (
        torch.randn(3, 4, 6, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
    )
    gW = [torch.randn(3, 4, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    gb = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    for s in range(2):
        for j, norm in enumerate((50.0, 0.5, 4.0)):
            t = torch.sqrt(gW[s][j].square().sum() + gb[s][j].square().sum())
            gW[s][j] *= norm / t
            gb[s][j] *= norm / t
    opt = ClippedSGD(lr=0.1, momentum=0.9, weight_decay=0.01, max_norm=3.0)
    params = {"W": W0.clone(), "b": b0.clone()}
    opt.reset(params)
    opt.step(params, {"W": gW[0].clone(), "b": gb[0].clone()}, 3)
    opt.step(params, {"W": gW[1][:2].clone(), "b": gb[1][:2].clone()}, 2)
    for j in range(3):
        W, b = W0[j].clone().requires_grad_(True), b0[j].clone().requires_grad_(True)
        ref = torch.optim.SGD([W, b], lr=0.1, momentum=0.9, weight_decay=0.01)
        for s in range(2 if j < 2 else 1):
            W.grad, b.grad = gW[s][j].clone(), gb[s][j].clone()
            torch.nn.utils.clip_grad_norm_([W, b], max_norm=3.0)
            ref.step()
        torch.testing.assert_close(params["W"][j], W.detach(), atol=1e-14, rtol=1e-12)
        torch.testing.assert_close(params["b"][j], b.detach(), atol=1e-14, rtol=1e-12)


# ---------------------------------------------------------------------------------- registry, errors
def test_listed_with_their_capabilities():
    rows = {r["name"]: r for r in method_table()}
    for name in ("scaffold", "feddyn"):
        assert rows[name]["kernels"] == "torch" and rows[name]["stacks"] == "yes"
        assert rows[name]["defaults"]["momentum"] == 0.0 and rows[name]["defaults"]["logit_scale"] == 100.0
    assert set(REGISTRY["scaffold"].declared_state()) == {"c", "c_local"}
    assert set(REGISTRY["feddyn"].declared_state()) == {"nabla"}
    r = run_cli(["methods"])
    assert r.exit_code == 0 and "scaffold" in r.output and "feddyn" in r.output


@pytest.mark.parametrize(
    "name, sets, says",
    [("scaffold", {"global_lr": "0"}, "global_lr > 0"), ("feddyn", {"alpha": "0"}, "alpha > 0"),
     ("feddyn", {"max_grad_norm": "-1"}, "max_grad_norm >= 0"), ("feddyn", {"weights": "sizes"}, "weights")],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(name, sets, says):
    with pytest.raises(FedfeatError, match=says) as e:
        get_method(name, sets)
    assert "\n" not in str(e.value)


def test_the_linear_heads_keep_their_defaults():
    """The overridden defaults (logit scale, lr, plain SGD) are these methods' own, not the linear heads'."""
    from fedfeat.methods.head import LinearHeadParams

    assert dataclasses.asdict(LinearHeadParams())["logit_scale"] == 1.0
    assert get_method("fedavg").p.momentum == 0.9
