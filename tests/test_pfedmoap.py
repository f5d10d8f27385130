"""``pfedmoap`` (pFedMoAP) on the tiny open_clip ViT: its gating network's mixture-of-experts logits and loss against
a line-by-line transcription of the authors' code, the expert selection by hand, batched engine = loop engine, local
accuracy = each client's own model, and ``fedfeat train`` end to end with ``--local-test``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_clip import (
    fake_prompt_ctx,
    grab_setups,
    personal_data,
    run_cli,
    same_personal_runs,
    tiny_encoded_store,
)

from fedfeat.encoders.live import load_live_text
from fedfeat.engine.context import Batch
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.pfedmoap import GATING, select_experts
from fedfeat.store.featurestore import FeatureStore

FAST = {"n_ctx": "4", "batch_size": "8", "local_epochs": "2", "lr": "0.05", "gating_lr": "0.05"}
FRESH = {"optimizer_state": "fresh"}  # the batched program (carried optimisers run the clients one by one)


# ---------------------------------------------------------------------------------------- the code, transcribed
class CodeMultiheadAttention(nn.Module):
    """``ljaiverson/pFedMoAP@a481de35edc7c83244709f540f5fe573df4455dc`` ``trainers/pfedmoap.py:429-471``, line by
    line."""

    def __init__(self, d_model, num_heads, dropout=0.1, scaling=1.0, dtype=torch.float16):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.scaling = scaling
        self.dtype = dtype
        self.W_q = nn.Linear(d_model, d_model, dtype=self.dtype)
        self.W_k = nn.Linear(d_model, d_model, dtype=self.dtype)
        self.W_v = nn.Linear(d_model, d_model, dtype=self.dtype)
        self.W_o = nn.Linear(d_model, d_model, dtype=self.dtype)

    def scaled_dot_product_attention(self, Q, K, V, mask=None):
        attn_scores = torch.matmul(Q, K.transpose(-2, -1)) * self.scaling
        if mask is not None:
            attn_scores = attn_scores.masked_fill(mask == 0, -1e9)
        attn_probs = F.softmax(attn_scores, dim=-1)
        output = torch.matmul(attn_probs, V)
        return output, attn_probs

    def split_heads(self, x):
        batch_size, seq_length, d_model = x.size()
        return x.view(batch_size, seq_length, self.num_heads, self.d_k).transpose(1, 2)

    def combine_heads(self, x):
        batch_size, num_heads, seq_length, d_k = x.size()
        return x.transpose(1, 2).contiguous().view(batch_size, seq_length, self.d_model)

    def forward(self, Q, K, V, mask=None):
        Q = self.split_heads(self.W_q(Q))
        K = self.split_heads(self.W_k(K))
        V = self.split_heads(self.W_v(V))
        attn_output, attn_probs = self.scaled_dot_product_attention(Q, K, V, mask)
        output = self.W_o(self.combine_heads(attn_output))
        return output, torch.mean(attn_probs, dim=1)


def code_forward(
    image_features, text_features, nonlocal_text_features, gating, reduce_times, n_class, lmbda, scale
):
    """``pfedmoap.py:176-183`` ``pool`` and ``:217-237`` ``CustomCLIP.forward`` after the encoders (``text_features``
    the local prompt's raw text features, ``nonlocal_text_features`` a list of pooled unit ones, :203-207)."""

    def pool(t):
        if len(t.shape) == 3:
            return t[:, :, ::reduce_times]
        if len(t.shape) == 2:
            return t[:, ::reduce_times]

    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    logit_scale = scale
    local_logits = logit_scale * image_features @ text_features.t()
    if nonlocal_text_features:
        q = pool(image_features).repeat(n_class, 1, 1)  # (n_class, Batch, feature_dim)
        k = v = torch.stack([pool(text_features)] + nonlocal_text_features).permute(1, 0, 2)
        new_features = gating(q, k, v)[0].permute(1, 2, 0)  # (Batch, feature_dim, n_class)
        return lmbda * local_logits + logit_scale * torch.bmm(
            pool(image_features).unsqueeze(1), new_features
        ).squeeze(1)
    else:
        return local_logits


# ---------------------------------------------------------------------------------------- on the tiny store
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_encoded_store(tmp_path_factory.mktemp("moap"), n_test=40)


@pytest.fixture(scope="module")
def live(store):
    return load_live_text(FeatureStore.open(store))


def _fake_ctx(live, n_clients=4, seed=0):
    return fake_prompt_ctx(live, n_clients, seed)


@pytest.mark.parametrize(
    "sets", [{}, {"gating_embed_dim": "16", "gating_heads": "4", "lmbda": "0.2", "scaling": "3"}]
)
def test_moe_logits_and_loss_equal_the_code(live, sets):
    m = get_method("pfedmoap", {"n_ctx": "3", "precision": "fp32", "num_experts": "3"} | sets)
    ctx = _fake_ctx(live)
    m.setup(ctx)
    p = m.p
    g = torch.Generator().manual_seed(3)
    W = live.tower.width
    # stored prompts of clients 0..3 (client 3 never trained: no expert), clients 0, 1, 2 train this round
    ctx.state["client_prompt"] = 0.3 * torch.randn(4, 3, W, generator=g)
    ctx.state["client_seen"] = torch.tensor([True, True, False, True])
    for k in GATING:
        ctx.state[f"client_{k}"] = ctx.state[f"client_{k}"] + 0.2 * torch.randn(
            ctx.state[f"client_{k}"].shape, generator=g
        )
    plan = SimpleNamespace(clients=torch.tensor([0, 1, 2]))
    m.make_optimizer(1)
    params = {"ctx": 0.3 * torch.randn(3, 3, W, generator=g), **m.local_params(ctx, plan)}
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    local = m.local_begin(ctx, plan, {})
    assert local["gated"].tolist() == [True, True, False]  # client 2's first participation: its prompt alone
    n, B = 3, 6
    D = m.learner.features(params["ctx"][:1].detach()).shape[-1]
    x = F.normalize(torch.randn(n, B, D, generator=g), dim=-1)
    y = torch.randint(0, ctx.K, (n, B), generator=g)
    mask = torch.ones(n, B, dtype=torch.bool)
    mask[1, B - 2 :] = False
    batch = Batch(x, mask, torch.zeros(n, B, dtype=torch.int64), n, 0, 0, y)
    loss = m.step_loss(ctx, params, batch, local)
    grads = torch.autograd.grad(loss.sum(), list(params.values()))
    grads = dict(zip(params, grads))
    r = m.pool_every
    for i in range(n):
        ctx_i = params["ctx"][i].detach().clone().requires_grad_(True)
        gating = CodeMultiheadAttention(
            len(range(0, D, r)), p.gating_heads, scaling=p.scaling, dtype=torch.float32
        )
        with torch.no_grad():
            for name, (w, b) in zip("qkvo", [("wq", "bq"), ("wk", "bk"), ("wv", "bv"), ("wo", "bo")]):
                getattr(gating, f"W_{name}").weight.copy_(params[w][i])
                getattr(gating, f"W_{name}").bias.copy_(params[b][i])
        nonlocal_tf = []
        if local["gated"][
            i
        ]:  # the server's experts: the other trained clients (2 of them), pfedmoap.py:198-207
            others = [j for j in (0, 1, 3) if j != i]
            assert sorted(local["experts"].shape[1:2]) == [2]
            with torch.no_grad():
                for j in others:
                    tf = m.learner.features(ctx.state["client_prompt"][j : j + 1])[0]
                    tf = tf / tf.norm(dim=-1, keepdim=True)
                    nonlocal_tf.append(tf[:, ::r])
        tf = m.learner.features(ctx_i.unsqueeze(0))[0]
        z = code_forward(x[i], tf, nonlocal_tf, gating, r, ctx.K, p.lmbda, 100.0)
        keep = mask[i]
        want = F.cross_entropy(z[keep], y[i][keep])  # pfedmoap.py:373-374
        torch.testing.assert_close(loss[i], want, rtol=1e-5, atol=1e-5)
        gw = torch.autograd.grad(want, [ctx_i, *gating.parameters()], allow_unused=True)
        torch.testing.assert_close(grads["ctx"][i], gw[0], rtol=1e-4, atol=1e-5)
        if local["gated"][i]:
            code_names = [f"{a}{b}" for a in "qkvo" for b in "wb"]  # W_q.weight, W_q.bias, ...
            for (a, b), gg in zip(code_names, gw[1:]):
                torch.testing.assert_close(grads[f"{b}{a}"][i], gg, rtol=1e-4, atol=1e-5)
        else:
            assert all(float(grads[k][i].abs().max()) == 0 for k in GATING)


def test_select_experts_by_hand():
    prompts = torch.tensor([[0.0], [1.0], [3.0], [10.0], [2.5]]).view(5, 1, 1)
    seen = torch.tensor([True, True, True, True, False])
    order = torch.tensor([3, 0, 4, 2, 1])
    idx, real = select_experts(prompts, seen, torch.tensor([0, 2, 4]), 2, "nearest", order)
    assert idx[0].tolist() == [1, 2] and idx[1].tolist() == [1, 0] and real.all()
    assert idx[2].tolist() == [
        3,
        0,
    ]  # a client without a prompt of its own: the random order (pfedmoap.py:336-337)
    idx, real = select_experts(prompts, seen, torch.tensor([1]), 2, "random", order)
    assert idx[0].tolist() == [3, 0]
    idx, real = select_experts(prompts, torch.tensor([True, False, False, False, True]), torch.tensor([0]), 3,
                               "nearest", order)  # fmt: skip
    assert idx[0, :1].tolist() == [4] and real[0].tolist() == [True, False, False]


def test_params_are_checked():
    with pytest.raises(FedfeatError, match="csc"):
        get_method("pfedmoap", {"csc": "true"})
    with pytest.raises(FedfeatError, match="num_experts"):
        get_method("pfedmoap", {"num_experts": "0"})
    with pytest.raises(FedfeatError, match="lmbda"):
        get_method("pfedmoap", {"lmbda": "-1"})


# ---------------------------------------------------------------------------------------- runs
@pytest.fixture
def grab(monkeypatch):
    from fedfeat.methods import pfedmoap

    return grab_setups(monkeypatch, (pfedmoap.PFedMoAP,))


@pytest.mark.parametrize(
    "sets", [FRESH, {"precision": "fp32"}, FRESH | {"sparse_selection": "random", "num_experts": "2"}]
)
def test_batched_equals_loop_and_local_accuracy_is_each_clients_own(store, live, grab, sets):
    data = personal_data(store, live)
    m, g, rows, ctx = same_personal_runs("pfedmoap", FAST | sets, data, grab, rounds=3)
    assert set(g) == {"ctx", "client_prompt", *(f"client_{k}" for k in GATING)}
    assert bool(ctx.state["client_gated"].all())  # every client trained its gating from round 2 on
    assert not torch.allclose(g["client_wq"][0], g["client_wq"][1])  # trained apart
    assert not torch.allclose(g["client_prompt"][0], g["client_prompt"][1])
    # the local accuracy: each client's stored prompt + gating + experts, recomputed one client at a time
    accs = []
    C = ctx.n_clients
    for k, r in enumerate(ctx.local_test):
        if len(r) == 0:
            continue
        with torch.no_grad():
            ex, real = m._experts(ctx, torch.tensor([k]))
            t = F.normalize(m.learner.features(g["client_prompt"][k : k + 1]), dim=-1)
            gate = {q: g[f"client_{q}"][k : k + 1] for q in GATING}
            z = m._logits(ctx, ctx.test_x[r].unsqueeze(0), t, gate, ex, real, torch.tensor([True]))[0]
        accs.append(100 * float((z.argmax(1) == data.test_y[r]).double().mean()))
    assert C == 3 and rows[-1]["local_acc"] == pytest.approx(sum(accs) / len(accs), abs=1e-9)


def test_train_end_to_end_with_local_test(store, tmp_path):
    sets = [x for k, v in (FAST | {"local_epochs": "1"}).items() for x in ("--set", f"{k}={v}")]
    r = run_cli(["train", "--method", "pfedmoap", "--store", store, "--partition", "dirichlet-joint", "--alpha",
                 "0.5", "--clients", "3", "--participation", "1", "--rounds", "2", "--local-test", "joint", "--quiet",
                 "--device", "cpu", *sets, "--out", tmp_path])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    (run,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == [0, 1, 2] and rows[-1]["local_acc"] is not None
