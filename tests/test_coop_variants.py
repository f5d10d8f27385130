"""fedkgcoop and fedcocoop (``fedfeat.methods.coop_variants``) on the tiny open_clip model: the KgCoOp loss and
CoCoOp's per-image prompts against transcriptions of the authors' code, batched = ``--engine loop``, and ``fedfeat
train`` end to end on the tiny encoded store."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers_clip import run_cli, tiny_encoded_store

from fedfeat.encoders.live import load_live_text
from fedfeat.engine.context import Batch
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import get_method
from fedfeat.methods.coop_variants import kg_score, meta_bias
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FeatureStore


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_encoded_store(tmp_path_factory.mktemp("data"), n_train=80, n_test=20, templates="single")


@pytest.fixture(scope="module")
def live(store):
    return load_live_text(FeatureStore.open(store))


def run_data(store, live, clients=3, alpha=0.3, dtype=torch.float32):
    st = FeatureStore.open(store)
    part = make_partition(st.labels("train"), "dirichlet", clients=clients, alpha=alpha, seed=3)
    data = load_run_data(st, part, dtype=dtype)
    if dtype != torch.float32:  # the live text tower in the same dtype (a copy: the fixture stays float32)
        import copy

        from fedfeat.encoders.prompt import TextTower

        live = copy.deepcopy(live)
        live.model.to(dtype)
        live.tower = TextTower.of(live.model, live.tower.tokenizer)
    data.live = live
    return data


def ready(store, live, name, sets, dtype=torch.float64):
    data = run_data(store, live, dtype=dtype)
    m = get_method(name, sets)
    ctx = build_context(data, m, 0, torch.device("cpu"))
    m.setup(ctx)
    return m, ctx


# ---- transcriptions of the authors' code


def ref_kg_score(text_features, text_features_):
    """boschresearch/FedTPG@f141c29 model/custom_coop.py:173-176 (= htyao89/KgCoOp@c43ccc3
    KgCoOp/trainers/kgcoop.py:238-241)."""
    cos = torch.nn.CosineSimilarity(dim=1, eps=1e-07)
    kg_score = cos(text_features, text_features_)
    kg_score = 1.0 - torch.mean(kg_score)
    return kg_score


class RefCoCoOpPromptLearner(nn.Module):
    """KaiyangZhou/CoOp@ff61507 trainers/cocoop.py:95-99 (meta_net) and 123-161 (construct_prompts, forward); the
    frozen prefix / suffix token embeddings (cocoop.py:108-116) are handed in."""

    def __init__(self, ctx, vis_dim, ctx_dim, token_prefix, token_suffix):
        super().__init__()
        self.ctx = nn.Parameter(ctx.clone())
        self.meta_net = nn.Sequential(
            OrderedDict(
                [
                    ("linear1", nn.Linear(vis_dim, vis_dim // 16)),
                    ("relu", nn.ReLU(inplace=True)),
                    ("linear2", nn.Linear(vis_dim // 16, ctx_dim)),
                ]
            )
        ).to(ctx.dtype)
        self.token_prefix, self.token_suffix = token_prefix, token_suffix
        self.n_cls = token_prefix.shape[0]

    def construct_prompts(self, ctx, prefix, suffix, label=None):
        if label is not None:
            prefix = prefix[label]
            suffix = suffix[label]
        prompts = torch.cat([prefix, ctx, suffix], dim=1)
        return prompts

    def forward(self, im_features):
        prefix = self.token_prefix
        suffix = self.token_suffix
        ctx = self.ctx  # (n_ctx, ctx_dim)
        bias = self.meta_net(im_features)  # (batch, ctx_dim)
        bias = bias.unsqueeze(1)  # (batch, 1, ctx_dim)
        ctx = ctx.unsqueeze(0)  # (1, n_ctx, ctx_dim)
        ctx_shifted = ctx + bias  # (batch, n_ctx, ctx_dim)
        prompts = []
        for ctx_shifted_i in ctx_shifted:
            ctx_i = ctx_shifted_i.unsqueeze(0).expand(self.n_cls, -1, -1)
            pts_i = self.construct_prompts(ctx_i, prefix, suffix)  # (n_cls, n_tkn, ctx_dim)
            prompts.append(pts_i)
        prompts = torch.stack(prompts)
        return prompts


def ref_cocoop_logits(learner, text_encoder, tokenized_eot, image_features, logit_scale, label=None):
    """CoOp@ff61507 trainers/cocoop.py:174-194 CustomCLIP.forward from the (unit) image features on."""
    prompts = learner(image_features)
    logits = []
    for pts_i, imf_i in zip(prompts, image_features, strict=True):
        text_features = text_encoder(pts_i, tokenized_eot)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        l_i = logit_scale * imf_i @ text_features.t()
        logits.append(l_i)
    logits = torch.stack(logits)
    if label is not None:
        return F.cross_entropy(logits, label)
    return logits


# ---- (1) the authors' functions


def test_kg_score_equals_the_reference_per_client():
    g = torch.Generator().manual_seed(0)
    t, t0 = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    t, t0 = F.normalize(t, dim=-1), F.normalize(t0, dim=-1)
    got = kg_score(t, t0)
    want = torch.stack([ref_kg_score(t[i], t0[i]) for i in range(3)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    got = kg_score(t, t0, valid)  # padded class lists: each client's own classes only
    want = torch.stack([ref_kg_score(t[i][valid[i]], t0[i][valid[i]]) for i in range(3)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_kgcoop_loss_equals_the_reference(store, live):
    """``step_loss`` of every client = FedTPG's ``F.cross_entropy(output, labels) + w * score`` (client.py:141) over
    the client's own classes, relabelled, with the hand-crafted prompt's features through the tower."""
    m, ctx = ready(store, live, "fedkgcoop", {"kg_weight": "8"})
    glob = m.init_global(ctx)
    n, B = 3, 6
    ids = torch.arange(n)
    local = {"cls": m.cls[ids], "valid": m.valid[ids], "lut": m.lut[ids]}
    off = ctx.offsets.tolist()
    pos = torch.stack([torch.arange(off[i], off[i] + B) for i in range(n)])
    mask = torch.ones(n, B, dtype=torch.bool)
    mask[2, 4:] = False  # a partial batch
    batch = Batch(x=ctx.feats[pos], mask=mask, pos=pos, n=n, epoch=0, step=0, _y=ctx.labels[pos])
    params = {k: v.unsqueeze(0).expand(n, *v.shape).clone().requires_grad_(True) for k, v in glob.items()}
    got = m.step_loss(ctx, params, batch, local)
    t0_all = F.normalize(m.tower.encode([f"a photo of a {c}." for c in ctx.class_names]), dim=-1)
    for i in range(n):
        classes = m.cls[i][m.valid[i]]
        names = [ctx.class_names[int(c)] for c in classes]
        tf = F.normalize(m.learner.features(glob["ctx"][None], classes[None])[0], dim=-1)
        rows = mask[i]
        output = ctx.clip_logit_scale * ctx.feats[pos[i][rows]] @ tf.t()
        relabel = {int(c): j for j, c in enumerate(classes)}
        labels = torch.tensor([relabel[int(y)] for y in ctx.labels[pos[i][rows]]])
        want = F.cross_entropy(output, labels) + 8.0 * ref_kg_score(tf, t0_all[classes])
        assert len(names) == len(classes)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_cocoop_prompts_and_logits_equal_the_reference(store, live):
    """The batched meta-net, per-image prompts and logits = CoCoOp's loop over images (cocoop.py:144-194)."""
    m, ctx = ready(store, live, "fedcocoop", {"meta_reduction": "16"})
    glob = m.init_global(ctx)
    lr, tower = m.learner, m.tower
    D, W = ctx.text.shape[1], tower.width
    assert glob["meta_W1"].shape == (D // 16, D) and glob["meta_W2"].shape == (W, D // 16)
    ref = RefCoCoOpPromptLearner(glob["ctx"], D, W, lr.prefix, lr.suffix)
    with torch.no_grad():
        ref.meta_net.linear1.weight.copy_(glob["meta_W1"])
        ref.meta_net.linear1.bias.copy_(glob["meta_b1"])
        ref.meta_net.linear2.weight.copy_(glob["meta_W2"])
        ref.meta_net.linear2.bias.copy_(glob["meta_b2"])
    x = ctx.feats[:5]
    P = {k: v[None] for k, v in glob.items()}
    torch.testing.assert_close(meta_bias(P, x[None])[0], ref.meta_net(x), atol=1e-6, rtol=1e-5)
    shifted = m.shifted(P, x[None])[0]  # [5, n_ctx, W]
    ref_prompts = ref(x)  # [5, K, L, W]
    mine = torch.stack([lr.prompts(s[None]).view(lr.K, -1, W) for s in shifted])
    torch.testing.assert_close(mine, ref_prompts.to(mine.dtype), atol=1e-6, rtol=1e-5)
    want = ref_cocoop_logits(ref, tower.forward_embeddings, lr.eot, x, ctx.clip_logit_scale)
    got = m.predict(ctx, glob, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    sub = torch.tensor([7, 2, 4])
    assert torch.equal(m.predict_classes(ctx, glob, x, sub), sub[want[:, sub].argmax(1)])
    # the training loss: CE of each client's images over its own classes, padding rows skipped
    n, B = 2, 4
    ids = torch.arange(n)
    local = {"cls": m.cls[ids], "valid": m.valid[ids], "lut": m.lut[ids]}
    off = ctx.offsets.tolist()
    pos = torch.stack([torch.arange(off[i], off[i] + B) for i in range(n)])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    batch = Batch(x=ctx.feats[pos], mask=mask, pos=pos, n=n, epoch=0, step=0, _y=ctx.labels[pos])
    params = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in glob.items()}
    got = m.step_loss(ctx, params, batch, local)
    for i in range(n):
        classes = m.cls[i][m.valid[i]]
        ref_i = RefCoCoOpPromptLearner(glob["ctx"], D, W, lr.prefix[classes], lr.suffix[classes])
        ref_i.meta_net.load_state_dict(ref.meta_net.state_dict())
        relabel = {int(c): j for j, c in enumerate(classes)}
        xi = ctx.feats[pos[i][mask[i]]]
        labels = torch.tensor([relabel[int(y)] for y in ctx.labels[pos[i][mask[i]]]])
        want = ref_cocoop_logits(
            ref_i, tower.forward_embeddings, lr.eot[classes], xi, ctx.clip_logit_scale, labels
        )
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


# ---- (2) batched = loop


@pytest.mark.parametrize(
    "name, sets",
    [
        ("fedkgcoop", {}),
        ("fedkgcoop", {"classes": "all", "optimizer_state": "fresh", "kg_template": "store"}),
        ("fedcocoop", {}),
    ],
)
def test_batched_equals_loop_with_ragged_clients(store, live, name, sets):
    """In float64 (the tower too), two rounds, unequal clients with partial batches."""
    data = run_data(store, live, dtype=torch.float64)
    sizes = np.diff(data.offsets.numpy())
    assert len(set(sizes.tolist())) > 1 and any(s % 8 for s in sizes)
    runs = {}
    for engine in ("batched", "loop"):
        m = get_method(name, {"batch_size": "8", "lr": "0.05"} | sets)
        runs[engine] = run_federated(m, data, rounds=2, participation=1.0, seed=1, engine=engine)
    (gb, mb), (gl, ml) = runs["batched"], runs["loop"]
    for k in gb:
        torch.testing.assert_close(gb[k].double(), gl[k].double(), atol=1e-9, rtol=1e-9)
    assert [r["train_loss"] for r in mb] == pytest.approx([r["train_loss"] for r in ml], abs=1e-9)
    assert [r["test_acc"] for r in mb] == pytest.approx([r["test_acc"] for r in ml], abs=1e-9)
    first = run_federated(get_method(name, sets), data, rounds=0, participation=1.0, seed=1)[0]
    assert set(first) == set(gb)
    assert all(not torch.allclose(gb[k].double(), first[k].double()) for k in gb)  # every parameter trained


# ---- (3) the CLI


@pytest.mark.parametrize("method", ["fedkgcoop", "fedcocoop"])
def test_train_end_to_end_on_the_tiny_store(store, tmp_path, method):
    args = ["train", "--method", method, "--store", store, "--clients", "3", "--participation", "1"]
    args += ["--rounds", "2", "--out", tmp_path, "--quiet", "--device", "cpu", "--set", "batch_size=8"]
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    (run,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == [0, 1, 2] and rows[1]["train_loss"] > 0
    assert json.loads((run / "summary.json").read_text())["method"] == method
