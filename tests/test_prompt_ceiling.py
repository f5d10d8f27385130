"""The prompt benchmarks' ceilings are fair and fedfeat's batched local steps are the per-client steps: on the same
inputs, the independent CoOp / VPT-deep step on open_clip's own model (``tests/prompt_ceiling.py``) computes the
same loss and prompt gradients as fedfeat's ``step_loss``, and a round of ``run_local`` (all clients in one forward)
ends with the prompts of the plain per-client PyTorch loop (``torch.optim.SGD``, one client after another).
The setups are the benches' own (``bench/bench_prompt.py``, ``bench/bench_fedcopl.py``), smaller."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_fedcopl  # noqa: E402
import bench_prompt  # noqa: E402
from prompt_ceiling import fedcopl_loss, promptfl_loss  # noqa: E402

from fedfeat.engine.context import Batch, epoch_tables  # noqa: E402


def _batch(setup, x_of, labels):
    ctx, plan = setup["ctx"], setup["plan"]
    idx, mask = epoch_tables(ctx, plan, 0)
    ib = idx[0]
    return Batch(x_of(ib), mask[0], ib, plan.m, 0, 0, labels[ib] if labels is not None else None)


def _close_grads(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to float32 rounding of two summation orders (the ceiling layer-norms every token and then pools
    the EOT token; fedfeat pools, then layer-norms): 1e-4 of the largest entry."""
    top = float(b.abs().max())
    assert top > 0
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * top)


@pytest.fixture(scope="module")
def copl(tmp_path_factory):
    s = bench_fedcopl.build(
        tmp_path_factory.mktemp("copl"), clients=3, batch=8, steps=2, params={"n_ctx": "4"}
    )
    return s, bench_fedcopl.reference(s)


def test_fedcopl_ceiling_computes_fedfeats_loss_and_gradients(copl):
    s, (text, image) = copl
    m, ctx = s["method"], s["ctx"]
    P = {k: v.clone().requires_grad_(True) for k, v in bench_fedcopl.start_params(s).items()}
    batch = _batch(s, lambda ib: ctx.feats[ib], None)
    got = m.step_loss(ctx, P, batch, None)
    g_got = torch.autograd.grad(got.sum(), [P["text"], P["vpt"]])
    px, y = bench_fedcopl.batches(s)[0]
    want = fedcopl_loss(text, image, ctx.clip_logit_scale, P, px, y)
    g_want = torch.autograd.grad(want.sum(), [P["text"], P["vpt"]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_got, g_want):
        _close_grads(a, b)


def test_fedcopl_batched_round_equals_per_client_loop_and_ceiling(copl):
    s, ref = copl
    bs = bench_fedcopl.batches(s)
    lr = bench_fedcopl.epoch_lr(s["method"].p, 1, 0)
    got = bench_fedcopl.fedfeat_round(s)
    start = bench_fedcopl.start_params(s)
    for want in (bench_fedcopl.loop_round(s, ref, bs, lr), bench_fedcopl.ceiling_round(s, ref, bs, lr)):
        for k in ("text", "vpt"):
            assert not torch.allclose(want[k], start[k])
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=[10, 100])
def pfl(request, tmp_path_factory):
    from helpers_clip import make_tiny_clip

    d = tmp_path_factory.mktemp(f"pfl{request.param}")
    s = bench_prompt.build(bench_prompt.build_store(d, request.param, n_train=4 * 2 * 32), clients=4)
    return s, bench_prompt.reference(s, make_tiny_clip(d / "tiny"))


def test_promptfl_ceiling_computes_fedfeats_loss_and_gradients(pfl):
    s, text = pfl
    m, ctx = s["method"], s["ctx"]
    c = bench_prompt.start(s).requires_grad_(True)
    batch = _batch(s, lambda ib: ctx.feats[ib], ctx.labels)
    got = m.step_loss(ctx, {"ctx": c}, batch, None)
    (g_got,) = torch.autograd.grad(got.sum(), [c])
    x, y = bench_prompt.batches(s)[0]
    want = promptfl_loss(text, ctx.clip_logit_scale, c, x, y)
    (g_want,) = torch.autograd.grad(want.sum(), [c])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _close_grads(g_got, g_want)


def test_promptfl_batched_round_equals_per_client_loop_and_ceiling(pfl):
    s, text = pfl
    bs = bench_prompt.batches(s)
    lr = bench_prompt.epoch_lr(s["method"].p, 0)
    got = bench_prompt.fedfeat_round(s)
    for want in (bench_prompt.loop_round(s, text, bs, lr), bench_prompt.ceiling_round(s, text, bs, lr)):
        assert not torch.allclose(want, bench_prompt.start(s))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_blocks_are_open_clips_blocks(copl):
    """fedfeat.encoders.attention: the text tower's blocks and VPT's prompted blocks (prompt keys and values per
    client, no work on the stripped rows) give the modules' own outputs and gradients."""
    s, _ = copl
    m = s["method"]
    vit, tower = m.vit, m.learner.tower
    assert vit.fast
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, 32, 32, generator=g)
    prompts = torch.randn(3, vit.depth, vit.n_tokens, vit.width, generator=g).requires_grad_(True)
    owner = torch.tensor([0, 2, 1, 1, 0, 2])
    out = {}
    for fast in (True, False):
        vit.fast = fast
        f = vit.forward(x, prompts, owner)
        out[fast] = (f, torch.autograd.grad(f.square().sum(), [prompts])[0])
    vit.fast = True
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    c = torch.randn(2, m.learner.n_ctx, tower.width, generator=g).requires_grad_(True)
    L = m.learner.prefix.shape[1] + m.learner.n_ctx + m.learner.suffix.shape[1]
    assert tower._fast_blocks(tower.attn_mask[:L, :L], L)
    out = {}
    for fast in (True, False):
        tower._fast_memo = {L: fast}
        f = m.learner.features(c)
        out[fast] = (f, torch.autograd.grad(f.square().sum(), [c])[0])
    del tower._fast_memo
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
