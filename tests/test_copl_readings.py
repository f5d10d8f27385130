"""The reference codes' readings behind FedCoPL / FPL switches:

* ``fpl_select="stream"``: FPL's leaderboards (``BatsResearch/menghini-neurips23-code@b387624``
  ``utils/clip_pseudolabels.py:48-109``), checked against a line-by-line port of that loop on random inputs, and a
  hand case where the stream and the exact top-k part;
* ``fpl_select="topk"`` = CPL's ``InstanceSelector`` / ``ClassPool`` pools fed one hard candidate per sample (port);
* ``optimizer_state="carried"``: a tiny FedCoPL run equals a loop written here with two ``torch.optim.SGD`` (visual
  prompt, text context) made once, clients one after another, a per-epoch ``LambdaLR``, as ``krumpguo/FedCoPL`` does.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_clip import pixel_store

from fedfeat.errors import FedfeatError
from fedfeat.methods import pseudolabel as pl


# ------------------------------------------------------------------------------------------ FPL: the reference
def _reference_fpl(k: int, probs: torch.Tensor, rows: range, n_classes: int) -> list[tuple[int, int]]:
    """``compute_pseudo_labels`` (menghini-neurips23-code utils/clip_pseudolabels.py:48-109), line by line, one
    client: the samples stream in row order; the row index stands for ``image_path`` (ties: the higher row ranks
    higher, as the higher path does there). ``label_to_idx[classnames[i]]`` is ``i``. Returns sorted (row, label)."""
    top_k_leaderboard = {i: [] for i in range(n_classes)}
    for image_path in rows:
        p = probs[image_path].unsqueeze(0)  # the code: logits_per_image.softmax(dim=-1), [1, K]
        idx_preds = torch.argmax(p, dim=1)
        pred_id = idx_preds.item()
        pred = pred_id
        prob_score = p[0][pred_id]
        if len(top_k_leaderboard[pred]) < k:
            top_k_leaderboard[pred].append((prob_score, image_path))
        elif top_k_leaderboard[pred][-1][0] < prob_score:
            top_k_leaderboard[pred] = sorted(
                top_k_leaderboard[pred] + [(p[0][pred_id], image_path)], reverse=True
            )[:k]
        else:
            order_of_classes = sorted([(p[0][j], j) for j in range(n_classes) if j != pred_id], reverse=True)
            for _score, index in order_of_classes:
                index_dict = index
                if len(top_k_leaderboard[index_dict]) < k:
                    top_k_leaderboard[index_dict].append((p[0][index], image_path))
                elif top_k_leaderboard[index_dict][-1][0] < p[0][index]:
                    top_k_leaderboard[index_dict] = sorted(
                        top_k_leaderboard[index_dict] + [(p[0][index], image_path)], reverse=True
                    )[:k]
    out = []
    for index, leaderboard in top_k_leaderboard.items():
        out += [(tup[1], index) for tup in leaderboard]
    return sorted(out)


def _random_case(g: torch.Generator, trial: int):
    K = 2 + trial % 6
    sizes = torch.randint(0, 30, (4,), generator=g)
    sizes[trial % 4] = 0 if trial % 5 == 0 else sizes[trial % 4]  # sometimes an empty client
    seg = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    probs = torch.softmax(torch.randn(int(seg[-1]), K, generator=g) * 2, -1)
    if trial % 3 == 0:
        probs = (probs * 10).round() / 10  # many ties, in scores and in argmax
    return probs, seg, K, 1 + trial % 4


def test_stream_equals_a_line_by_line_port_of_the_fpl_code():
    """Per client, on random probabilities (ties included, an empty client sometimes): the same (row, label) pairs,
    duplicates included, as the reference loop run on each client's rows in order. The exact top-k differs on many
    of the cases."""
    g = torch.Generator().manual_seed(0)
    differ = 0
    for trial in range(40):
        probs, seg, K, k = _random_case(g, trial)
        want = []
        for c in range(len(seg) - 1):
            want += _reference_fpl(k, probs, range(int(seg[c]), int(seg[c + 1])), K)
        rows, labels = pl.fpl_select(probs, seg, k)  # the default: stream
        assert list(zip(rows.tolist(), labels.tolist())) == sorted(want), trial
        assert torch.equal(rows, rows.sort().values)
        top = set(zip(*[x.tolist() for x in pl.fpl_select(probs, seg, k, select="topk")]))
        differ += top != set(want)
    assert differ >= 15


def test_stream_and_topk_part_by_hand():
    """One client, k = 2, two classes, streamed in row order:
    r0 (.9) and r1 (.6) fill class 0's board, whose board[-1] is r1 (.6); r2 (.7 > .6) enters, the board is sorted
    and cut: {r0, r2}, board[-1] .7; r3 predicts 0 at .65 < .7: offered to class 1, whose board is empty -> r3 with
    label 1; r4 (.8) fills class 1's board: board[-1] is r4 (.8), the last appended, not r3's .35; r5 predicts 1 at
    .7 < .8: rejected, offered to class 0 at .3 < .7: nowhere. Stream: {(0,0), (2,0), (3,1), (4,1)}. Top-k: class 0
    {r0, r2} of {r0, r1, r2, r3}, class 1 {r4, r5}."""
    p = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.65, 0.35], [0.2, 0.8], [0.3, 0.7]])
    rows, y = pl.fpl_select(p, None, k=2)
    assert rows.tolist() == [0, 2, 3, 4] and y.tolist() == [0, 0, 1, 1]
    rows, y = pl.fpl_select(p, None, k=2, select="topk")
    assert rows.tolist() == [0, 2, 4, 5] and y.tolist() == [0, 0, 1, 1]


def test_a_rejected_sample_joins_every_other_board():
    """k = 1, three classes. Client 0 (rows 0-1): r1 misses class 0 (.45, not > .5) and joins the empty boards of
    classes 1 and 2, each with its label. Client 1 (rows 2-5 = a, b, c, a): r2 -> class 2 (.6), r3 -> class 0 (.5);
    r4 misses class 0 and joins class 1 (empty), not class 2 (.2, not > .6); r5 (.6, not > .6) is offered to class
    0 (.1) and 1 (.3 < .35): nowhere. The Selection keeps one entry per (row, label); offsets count entries."""
    a, b, c = [0.5, 0.3, 0.2], [0.45, 0.35, 0.2], [0.1, 0.3, 0.6]
    p = torch.tensor([a, b, c, a, b, c])
    seg = torch.tensor([0, 2, 6])
    sel = pl.make_pseudo_labeller("fpl", k=1)(p, seg)
    assert sel.rows.tolist() == [0, 1, 1, 2, 3, 4] and sel.labels.tolist() == [0, 1, 2, 2, 0, 1]
    assert sel.offsets.tolist() == [0, 3, 6]
    assert torch.equal(sel.candidates, F.one_hot(sel.labels, 3).bool())
    topk = pl.make_pseudo_labeller("fpl", k=1, select="topk")(p, seg)  # the tie .6/.6 goes to the lower row
    assert topk.rows.tolist() == [0, 2, 3] and topk.labels.tolist() == [0, 2, 0]
    assert topk.offsets.tolist() == [0, 1, 3]


def test_select_is_checked():
    with pytest.raises(
        FedfeatError, match=r"fpl_select must be 'stream' .* got 'top'; e.g. --set fpl_select=topk"
    ):
        pl.fpl_select(torch.full((2, 2), 0.5), None, 1, select="top")
    with pytest.raises(FedfeatError, match="fpl_select must be"):
        pl.FPL(k=2, select="best")
    from fedfeat.methods import get_method

    assert get_method("fedcopl", {"pseudo": "fpl"}).p.fpl_select == "stream"
    assert get_method("copl-linear", {"fpl_select": "topk"}).p.fpl_select == "topk"
    assert get_method("fedcopl", {}).p.optimizer_state == "fresh"
    with pytest.raises(FedfeatError):
        get_method("fedcopl", {"fpl_select": "best"})


# ------------------------------------------------------- topk = CPL's InstanceSelector with one hard candidate
def _reference_hard_pools(probs: torch.Tensor, k: int) -> list[int]:
    """CPL ``InstanceSelector.select_topk_for_eachcls`` / ``_fill_pools`` with one-hot labels (what FedCoPL feeds
    it, ``fedcopl.py:474-488``), one client: a single proposal round, pools filled class by class, samples in row
    order, ``ClassPool.update`` (``utils/utils.py:513-555``): append while not full (uncertainty < 1e4), else replace
    the slot ``torch.max`` reports for the largest uncertainty if it is strictly larger."""
    conf = probs  # the code's F.softmax(logits) (clip_pseudolabels.py:334), i.e. the probabilities
    pred = conf.argmax(1)
    unc = 1 - conf[torch.arange(len(conf)), pred]
    pools = {}
    for c in sorted(set(pred.tolist())):
        pool_idx, pool_unc = [], []
        for i in [i for i in range(len(probs)) if pred[i] == c]:
            if len(pool_idx) < k:
                if unc[i] < 1e4:
                    pool_idx.append(i)
                    pool_unc.append(unc[i])
            else:
                j = int(torch.argmax(torch.stack(pool_unc)))
                if not pool_unc[j] <= unc[i]:
                    pool_idx[j], pool_unc[j] = i, unc[i]
        pools[c] = pool_idx
    return sorted(i for v in pools.values() for i in v)


def test_topk_equals_cpls_pools_with_one_hard_candidate():
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        probs = torch.softmax(
            torch.randn(25 + trial, 2 + trial % 5, generator=g, dtype=torch.float64) * 2, -1
        )
        k = 1 + trial % 4
        assert pl.fpl_topk(probs, None, k)[0].tolist() == _reference_hard_pools(probs, k)


# --------------------------------------------------------------------------- FedCoPL's carried optimiser
FAST = {
    "pseudo": "fpl",
    "pseudo_k": "4",
    "local_epochs": "2",
    "batch_size": "8",
    "refresh": "1",
    "n_ctx": "4",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("readings")
    return pixel_store(d)


def _data(store):
    from fedfeat.encoders.live import load_live_text
    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import make_partition
    from fedfeat.store.featurestore import FeatureStore

    st = FeatureStore.open(store)
    part = make_partition(
        st.labels("train"), "dirichlet-joint", clients=2, alpha=0.5, test_labels=st.labels("test")
    )
    data = load_run_data(st, part, local_test="joint")
    data.live = load_live_text(st)
    return data


def _engine_run(data, sets, engine="batched", rounds=2):
    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods import fedcopl, get_method

    seen = {}
    orig = fedcopl.FedCoPL.setup

    def setup(self, ctx):
        seen["ctx"] = ctx
        return orig(self, ctx)

    fedcopl.FedCoPL.setup = setup
    try:
        m = get_method("fedcopl", sets)
        glob, rows = run_federated(m, data, rounds=rounds, participation=1.0, seed=0, engine=engine)
    finally:
        fedcopl.FedCoPL.setup = orig
    return glob, seen["ctx"]


def _reference_loop(data, sets, rounds=2):
    """FedCoPL's trainer (krumpguo/FedCoPL methods/main_UL.py:525-550, fedcopl.py:199-216, 257-306, 584-632) on the
    method's encoders: one visual-prompt and one text-context Parameter, each with its torch.optim.SGD (lr 0.1,
    momentum 0.9, weight decay 0.05) and a cosine LambdaLR stepped per epoch with the epoch index, made once; every
    round the clients in ascending id load the global visual prompt and their own text context into the same
    Parameters and train; the server averages the visual prompts weighted by the selected-set sizes."""
    from fedfeat.engine.context import RoundPlan, epoch_tables, make_plan
    from fedfeat.engine.data import build_context
    from fedfeat.methods import get_method

    m = get_method("fedcopl", sets)
    p = m.p
    ctx = build_context(data, m, 0, torch.device("cpu"))
    m.setup(ctx)
    glob = m.init_global(ctx)
    vpt = torch.nn.Parameter(glob["vpt"].clone())
    text = torch.nn.Parameter(m.init["text"].clone())
    opts = [
        torch.optim.SGD([w], lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay) for w in (vpt, text)
    ]
    T = (
        p.local_epochs * p.refresh
    )  # make_scheduler: EPOCHS * num_repesudo_round, warmup 0, WarmupCosineSchedule
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: max(0.0, 0.5 * (1 + math.cos(math.pi * e / T))))
              for o in opts]  # fmt: skip
    C = ctx.n_clients
    for rnd in range(1, rounds + 1):
        m.round_begin(ctx, rnd, glob)  # pseudo-labels (the same code in both runs)
        plan = make_plan(ctx, rnd, np.arange(C), p.batch_size, p.local_epochs)
        ups = []
        for c in range(C):  # main_UL.py:527, ascending client id
            with torch.no_grad():  # load_state_dict into the same Parameters: the optimisers' buffers stay
                vpt.copy_(glob["vpt"])
                text.copy_(ctx.state["client_text"][c])
            one = RoundPlan(rnd, torch.tensor([c]), ctx.sizes(torch.tensor([c])),
                            plan.steps[plan.clients == c], p.batch_size, p.local_epochs)  # fmt: skip
            for e in range(p.local_epochs):
                with warnings.catch_warnings():  # the code's scheduler.step(epoch=...) is deprecated in torch
                    warnings.simplefilter("ignore")
                    for s in scheds:
                        s.step(((rnd - 1) % p.refresh) * p.local_epochs + e)
                idx, mask = epoch_tables(ctx, one, e)
                for st in range(idx.shape[0]):
                    pos = idx[st, 0][mask[st, 0]]
                    if len(pos) == 0:
                        continue
                    orig = ctx.state["sel_orig"][pos]
                    owner = torch.zeros(len(pos), dtype=torch.int64)
                    f = m._images(ctx, ctx.cache["train_pixels"][orig], vpt.unsqueeze(0), owner)
                    t = m._text({"text": text.unsqueeze(0)})[0]
                    loss = F.cross_entropy(ctx.clip_logit_scale * f @ t.T, ctx.state["pl_labels"][pos])
                    for o in opts:
                        o.zero_grad()
                    loss.backward()
                    for o in opts:
                        o.step()
            ups.append(vpt.detach().clone())
            ctx.state["client_text"][c] = text.detach().clone()
        w = ctx.offsets.diff().to(vpt.dtype)
        glob = {"vpt": sum(wi * u for wi, u in zip(w, ups)) / w.sum()}
    return glob, ctx


def test_carried_optimizer_equals_the_reference_trainer_loop(store):
    """Two clients, two rounds (each a pseudo-label refresh, the second from the trained prompts): the global visual
    prompt and both personal text contexts equal the reference loop's, with either engine; fresh optimisers give
    other prompts."""
    data = _data(store)
    sets = FAST | {"optimizer_state": "carried"}
    want_glob, want_ctx = _reference_loop(data, sets)
    for engine in ("batched", "loop"):
        glob, ctx = _engine_run(data, sets, engine)
        torch.testing.assert_close(glob["vpt"], want_glob["vpt"], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(
            ctx.state["client_text"], want_ctx.state["client_text"], atol=2e-5, rtol=1e-4
        )
        assert torch.equal(ctx.state["sel_orig"], want_ctx.state["sel_orig"])
    fresh, fctx = _engine_run(data, FAST)
    assert (fresh["vpt"] - want_glob["vpt"]).abs().max() > 1e-3
    assert (fctx.state["client_text"] - want_ctx.state["client_text"]).abs().max() > 1e-3
