"""``fedpgp`` (FedPGP) and ``promptfolio`` (PromptFolio) on the tiny open_clip ViT: their losses and prompt
compositions against line-by-line transcriptions of the authors' code, batched engine = loop engine, local accuracy =
each client's own model recomputed here, and ``fedfeat train`` end to end with ``--local-test``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
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
from fedfeat.methods.prompt_personal import folio_features, pgp_contexts, pgp_contrastive
from fedfeat.store.featurestore import FeatureStore

FAST = {"n_ctx": "4", "batch_size": "8", "local_epochs": "2", "lr": "0.05"}
FRESH = {"optimizer_state": "fresh"}  # the batched program (carried optimisers run the clients one by one)
CPL = {"pseudo": "cpl", "pseudo_k": "3", "conf_quantile": 50.0, "regular_threshold": 0.5}


# ---------------------------------------------------------------------------------------- the codes, transcribed
class PGPPromptLearner:
    """``TianyuCuiOvO/FedPGP@d43045b`` ``trainers/fedpgp.py:139-194, 242`` ``PromptLearner.forward``
    (``class_token_position == "end"``), line by line; ``embedding`` the token embeddings of the tokenized
    ``"X X .. X {class}."`` prompts repeated ``N`` times (:119-131)."""

    def __init__(self, U, V, sigma, embedding, n_cls, n_ctx, N):
        self.U, self.V, self.sigma, self.embedding = U, V, sigma, embedding
        self.token_prefix = embedding[:, :1, :]  # :129
        self.token_suffix = embedding[:, 1 + n_ctx :, :]  # :130
        self.n_cls, self.n_ctx, self.N = n_cls, n_ctx, N
        self.class_token_position = "end"

    def forward(self):
        U = self.U
        V = self.V
        UV = torch.matmul(U, V)
        sigma = self.sigma
        ctx = UV + self.sigma
        embedding = self.embedding

        if ctx.dim() == 3:
            ctx = ctx.unsqueeze(0).expand(self.n_cls, -1, -1, -1)

        ctx = ctx.permute(1, 0, 2, 3)
        ctx = ctx.contiguous().view(self.N * self.n_cls, self.n_ctx, ctx.shape[3])

        if UV.dim() == 3:
            UV = UV.unsqueeze(0).expand(self.n_cls, -1, -1, -1)

        UV = UV.permute(1, 0, 2, 3)
        UV = UV.contiguous().view(self.N * self.n_cls, self.n_ctx, UV.shape[3])

        if sigma.dim() == 3:
            sigma = sigma.unsqueeze(0).expand(self.n_cls, -1, -1, -1)

        sigma = sigma.permute(1, 0, 2, 3)
        sigma = sigma.contiguous().view(self.N * self.n_cls, self.n_ctx, sigma.shape[3])

        prefix = self.token_prefix
        suffix = self.token_suffix

        if self.class_token_position == "end":
            prompts = torch.cat([prefix, ctx, suffix], dim=1)
            prompts_sigma = torch.cat([prefix, sigma, suffix], dim=1)
            prompts_UV = torch.cat([prefix, UV, suffix], dim=1)
        return embedding, prompts_sigma, prompts_UV, prompts


def pgp_code_loss(
    learner, text_encoder, tokenized_prompts, image_features, label, logit_scale, mu, temp, t0=None
):
    """``fedpgp.py:255-277`` ``CustomCLIP.forward`` (training branch, after the image encoder: ``image_features``
    already unit) and ``:344-366`` ``forward_backward`` (fp32), line by line; ``t0`` replaces the hand-crafted
    prompt's features (``anchor="template"``)."""
    cos = torch.nn.CosineSimilarity(dim=-1)
    embedding, prompts_sigma, prompts_UV, prompts = learner.forward()
    text_features = text_encoder(prompts, tokenized_prompts)
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    text_features_0 = text_encoder(embedding, tokenized_prompts)
    text_features_sigma = text_encoder(prompts_sigma, tokenized_prompts)
    text_features_0 = text_features_0 / text_features_0.norm(dim=-1, keepdim=True)
    text_features_sigma = text_features_sigma / text_features_sigma.norm(dim=-1, keepdim=True)
    if t0 is not None:
        text_features_0 = t0
    output = logit_scale * image_features @ text_features.t()

    posi = cos(text_features_0, text_features_sigma)
    nega = cos(text_features_sigma, text_features)
    logits = torch.cat((posi.reshape(-1, 1), nega.reshape(-1, 1)), dim=1)
    logits /= temp
    target = torch.zeros(logits.size(0)).long()
    loss2 = F.cross_entropy(logits, target)
    loss = F.cross_entropy(output, label)
    loss += mu * loss2
    return loss, output


class FolioPromptLearner:
    """``PanBikang/PromptFolio@8f729aa`` ``trainers/PromptFolio.py:128-146, 194`` ``PromptLearner.forward`` (unified
    contexts, ``class_token_position == "end"``), line by line; ``ctx  # [N, n_ctx, W]``."""

    def __init__(self, ctx, embedding, n_cls, n_ctx, N):
        self.ctx = ctx
        self.token_prefix = embedding[:, :1, :]  # :103
        self.token_suffix = embedding[:, 1 + n_ctx :, :]  # :104
        self.n_cls, self.n_ctx, self.N = n_cls, n_ctx, N
        self.class_specific_context = False
        self.class_token_position = "end"

    def forward(self):
        ctx = self.ctx
        if not self.class_specific_context:
            ctx = ctx.unsqueeze(0).expand(self.n_cls, -1, -1, -1)
            ctx = ctx.permute(1, 0, 2, 3)
            ctx = ctx.contiguous().view(self.N * self.n_cls, self.n_ctx, ctx.shape[3])

        prefix = self.token_prefix
        suffix = self.token_suffix

        if self.class_token_position == "end":
            prompts = torch.cat([prefix, ctx, suffix], dim=1)
        return prompts


def folio_code_logits(learner, text_encoder, tokenized_prompts, image_features, n_cls, frac, logit_scale):
    """``PromptFolio.py:215-235`` ``CustomCLIP.forward`` after the image encoder, line by line."""
    prompts = learner.forward()
    text_features0 = text_encoder(prompts[:n_cls], tokenized_prompts[:n_cls])
    text_features1 = text_encoder(prompts[n_cls : 2 * n_cls], tokenized_prompts[n_cls : 2 * n_cls])
    text_features0 = text_features0 / text_features0.norm(dim=-1, keepdim=True)
    text_features1 = text_features1 / text_features1.norm(dim=-1, keepdim=True)
    text_features = (1 - frac) * text_features0 + frac * text_features1
    logits = logit_scale * image_features @ text_features.t()
    return logits


# ---------------------------------------------------------------------------------------- on the tiny store
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_encoded_store(tmp_path_factory.mktemp("pp"), n_test=40)


@pytest.fixture(scope="module")
def live(store):
    return load_live_text(FeatureStore.open(store))


def _fake_ctx(live, n_clients=2, seed=0):
    return fake_prompt_ctx(live, n_clients, seed)


def _code_encoder(tower):
    """CoOp's / the codes' ``TextEncoder.forward`` (full-length prompts, EOT at ``tokenized_prompts.argmax(-1)``)."""
    return lambda prompts, tok: tower.forward_embeddings(prompts, tok.argmax(dim=-1))


def _code_embedding(tower, names, n_ctx, N):
    prompts = [" ".join(["X"] * n_ctx) + " " + n + "." for n in names]  # fedpgp.py:117, PromptFolio.py:98
    tok = tower.tokenize(prompts).repeat(N, 1)  # fedpgp.py:120, PromptFolio.py:100
    return tower.embed(tok), tok


def _batch(ctx, n, B, D, g):
    x = F.normalize(torch.randn(n, B, D, generator=g), dim=-1)
    y = torch.randint(0, ctx.K, (n, B), generator=g)
    mask = torch.ones(n, B, dtype=torch.bool)
    mask[1, B - 2 :] = False  # a ragged last batch
    return Batch(x, mask, torch.zeros(n, B, dtype=torch.int64), n, 0, 0, y)


@pytest.mark.parametrize("sets", [{}, {"mu": "1", "temp": "0.2", "bottleneck": "3"}, {"anchor": "template"}])
def test_fedpgp_loss_and_prompts_equal_the_code(live, sets):
    m = get_method("fedpgp", {"n_ctx": "4", "bottleneck": "2"} | sets)
    ctx = _fake_ctx(live)
    m.setup(ctx)
    p = m.p
    n, B, W = 2, 6, live.tower.width
    g = torch.Generator().manual_seed(1)
    params = {
        "ctx": 0.3 * torch.randn(n, p.n_ctx, W, generator=g),
        "U": 0.5 * torch.randn(n, p.n_ctx, p.bottleneck, generator=g),
        "V": 0.5 * torch.randn(n, p.bottleneck, W, generator=g),
    }
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    D = m.learner.features(params["ctx"][:1].detach()).shape[-1]
    batch = _batch(ctx, n, B, D, g)
    loss = m.step_loss(ctx, params, batch, {})
    grads = torch.autograd.grad(loss.sum(), list(params.values()))
    # the code, one client at a time (full-length prompts, its own N = 1 learner)
    emb, tok = _code_embedding(live.tower, ctx.class_names, p.n_ctx, 1)
    enc = _code_encoder(live.tower)
    t0 = ctx.text if p.anchor == "template" else None
    for i in range(n):
        leaves = [params[k][i : i + 1].detach().clone().requires_grad_(True) for k in ("U", "V", "ctx")]
        U, V, sigma = leaves
        code = PGPPromptLearner(U, V, sigma, emb, ctx.K, p.n_ctx, 1)
        keep = batch.mask[i]
        want, _ = pgp_code_loss(code, enc, tok, batch.x[i][keep], batch.y[i][keep], 100.0, p.mu, p.temp, t0)
        torch.testing.assert_close(loss[i], want, rtol=1e-5, atol=1e-5)
        gU, gV, gs = torch.autograd.grad(want, leaves)
        torch.testing.assert_close(grads[1][i], gU[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads[2][i], gV[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads[0][i], gs[0], rtol=1e-4, atol=1e-5)
    # the personalised prompts are the code's ctx = UV + sigma, and its prompts_sigma / prompts_UV parts
    i = 1
    code = PGPPromptLearner(params["U"][i : i + 1], params["V"][i : i + 1], params["ctx"][i : i + 1], emb, ctx.K,
                            p.n_ctx, 1)  # fmt: skip
    _, ps, puv, pr = code.forward()
    full = pgp_contexts(params["ctx"], params["U"], params["V"])[i]
    torch.testing.assert_close(pr[:, 1 : 1 + p.n_ctx], full.expand(ctx.K, -1, -1))
    torch.testing.assert_close(ps[:, 1 : 1 + p.n_ctx], params["ctx"][i].expand(ctx.K, -1, -1))
    torch.testing.assert_close(
        puv[:, 1 : 1 + p.n_ctx], (params["U"][i] @ params["V"][i]).expand(ctx.K, -1, -1)
    )


def test_fedpgp_contrastive_by_hand():
    """``CE([posi, nega] / temp, 0) = log(e^(posi/temp) + e^(nega/temp)) - posi/temp``, averaged over the classes."""
    t0 = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    ts = torch.tensor([[[1.0, 1.0], [0.0, 2.0]]], dtype=torch.float64)
    tf = torch.tensor([[[-1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    r = 2**-0.5
    posi, nega = torch.tensor([r, 1.0]).double(), torch.tensor([-r, 0.0]).double()
    want = (torch.logaddexp(posi / 0.5, nega / 0.5) - posi / 0.5).mean()
    torch.testing.assert_close(pgp_contrastive(t0, ts, tf, 0.5), want.view(1))


@pytest.mark.parametrize("theta", ["0.4", "0", "1"])
def test_promptfolio_logits_equal_the_code(live, theta):
    m = get_method("promptfolio", {"n_ctx": "3", "theta": theta, "precision": "fp32"})
    ctx = _fake_ctx(live)
    m.setup(ctx)
    n, B, W = 2, 5, live.tower.width
    g = torch.Generator().manual_seed(2)
    params = {
        "ctx": 0.3 * torch.randn(n, 3, W, generator=g),
        "local": 0.3 * torch.randn(n, 3, W, generator=g),
    }
    t = m.client_text(ctx, params)
    batch = _batch(ctx, n, B, t.shape[-1], g)
    loss = m.step_loss(ctx, params, batch, {})
    emb, tok = _code_embedding(live.tower, ctx.class_names, 3, 2)
    for i in range(n):
        code = FolioPromptLearner(torch.stack([params["ctx"][i], params["local"][i]]), emb, ctx.K, 3, 2)
        keep = batch.mask[i]
        z = folio_code_logits(code, _code_encoder(live.tower), tok, batch.x[i], ctx.K, float(theta), 100.0)
        torch.testing.assert_close(100.0 * batch.x[i] @ t[i].T, z, rtol=1e-5, atol=1e-4)
        want = F.cross_entropy(z[keep], batch.y[i][keep])  # PromptFolio.py:342-344
        torch.testing.assert_close(loss[i], want, rtol=1e-5, atol=1e-5)


def test_folio_features_by_hand():
    a = torch.tensor([[3.0, 4.0]])
    b = torch.tensor([[0.0, 2.0]])
    torch.testing.assert_close(folio_features(a, b, 0.25), torch.tensor([[0.45, 0.8 * 0.75 + 0.25]]))


def test_params_are_checked():
    with pytest.raises(FedfeatError, match="bottleneck"):
        get_method("fedpgp", {"bottleneck": "0"})
    with pytest.raises(FedfeatError, match="ctx_init"):
        get_method("fedpgp", {"ctx_init": "a photo of a"})
    with pytest.raises(FedfeatError, match="theta"):
        get_method("promptfolio", {"theta": "1.5"})


# ---------------------------------------------------------------------------------------- runs
def _data(store, live):
    return personal_data(store, live)


@pytest.fixture
def grab(monkeypatch):
    """The Context each method's setup saw (``ctx.state`` and ``ctx.cache`` after the run)."""
    from fedfeat.methods import prompt_personal as pp

    return grab_setups(monkeypatch, (pp.FedPGP, pp.PromptFolio))


def _same_runs(name, sets, data, grab, rounds=2):
    return same_personal_runs(name, sets, data, grab, rounds)


@pytest.mark.parametrize("sets", [FRESH, CPL | FRESH, {"mu": "2"}])
def test_fedpgp_batched_equals_loop_and_local_accuracy_is_each_clients_own(store, live, grab, sets):
    data = _data(store, live)
    m, g, rows, ctx = _same_runs("fedpgp", FAST | {"bottleneck": "2"} | sets, data, grab)
    assert m.uses_labels is ("pseudo" not in sets)
    assert set(g) == {"ctx", "client_U", "client_V"}
    assert g["client_U"].shape == (3, 4, 2) and g["client_V"].shape[:2] == (3, 2)
    assert not torch.allclose(g["client_U"][0], g["client_U"][1])  # trained apart
    assert not torch.allclose(g["ctx"], m.init["ctx"])
    accs = []
    for k, r in enumerate(ctx.local_test):
        if len(r) == 0:
            continue
        with torch.no_grad():
            full = g["ctx"] + g["client_U"][k] @ g["client_V"][k]  # fedpgp.py:144-146
            t = F.normalize(m.learner.features(full.unsqueeze(0))[0], dim=-1)
        z = ctx.clip_logit_scale * ctx.test_x[r] @ t.T
        accs.append(100 * float((z.argmax(1) == data.test_y[r]).double().mean()))
    assert rows[-1]["local_acc"] == pytest.approx(np.mean(accs), abs=1e-9)
    with torch.no_grad():  # the global accuracy: sigma alone
        t = F.normalize(m.learner.features(g["ctx"].unsqueeze(0))[0], dim=-1)
    pred = (ctx.test_x @ t.T).argmax(1)
    assert rows[-1]["test_acc"] == pytest.approx(100 * float((pred == data.test_y).double().mean()), abs=1e-6)


@pytest.mark.parametrize("sets", [FRESH, CPL | FRESH, {"theta": "0.7", "precision": "fp32"}])
def test_promptfolio_batched_equals_loop_and_local_accuracy_is_each_clients_own(store, live, grab, sets):
    data = _data(store, live)
    m, g, rows, ctx = _same_runs("promptfolio", FAST | sets, data, grab)
    assert m.uses_labels is ("pseudo" not in sets)
    assert set(g) == {"ctx", "client_local"} and g["client_local"].shape[0] == 3
    assert not torch.allclose(g["client_local"][0], g["client_local"][1])
    assert not torch.allclose(g["client_local"][0], m.init["local"])
    theta = m.p.theta
    accs = []
    for k, r in enumerate(ctx.local_test):
        if len(r) == 0:
            continue
        with torch.no_grad():
            tg, tl = m.learner.features(torch.stack([g["ctx"], g["client_local"][k]]))
            t = (1 - theta) * tg / tg.norm(dim=-1, keepdim=True) + theta * tl / tl.norm(dim=-1, keepdim=True)
        z = ctx.clip_logit_scale * ctx.test_x[r] @ t.T
        accs.append(100 * float((z.argmax(1) == data.test_y[r]).double().mean()))
    assert rows[-1]["local_acc"] == pytest.approx(np.mean(accs), abs=1e-9)


@pytest.mark.parametrize("method", ["fedpgp", "promptfolio"])
def test_train_end_to_end_with_local_test(store, tmp_path, method):
    sets = [x for k, v in (FAST | {"local_epochs": "1"}).items() for x in ("--set", f"{k}={v}")]
    r = run_cli(["train", "--method", method, "--store", store, "--partition", "dirichlet-joint", "--alpha", "0.5",
                 "--clients", "3", "--participation", "1", "--rounds", "2", "--local-test", "joint", "--quiet",
                 "--device", "cpu", *sets, "--out", tmp_path])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    (run,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == [0, 1, 2] and rows[-1]["local_acc"] is not None
