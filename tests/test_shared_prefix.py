"""The shared-prefix path of the CoOp text tower (``PromptLearner(shared_prefix=True)``,
``TextTower.forward_shared``): ``[SOS] ctx_1 .. ctx_n`` run once per client, each class's name .. ``[EOS]``
attending to the prefix's cached keys / values. The same features and context gradients as the full path (float64
to 1e-9, float32 to 1e-5), on the tiny open_clip tower and a random-init ViT-B-32 text tower, and the same
``promptfl`` training."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers_clip import (
    make_tiny_clip,
    reference_model,
    tiny_encoded_store,
)

from fedfeat.encoders.live import load_live_text
from fedfeat.encoders.prompt import PromptLearner, TextTower
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import REGISTRY, get_method
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FeatureStore

NAMES = ["cat", "dog", "sea lion", "aquarium fish", "great white shark", "maple tree", "x"]
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
FAST = {"batch_size": "8", "local_epochs": "2", "n_ctx": "4", "lr": "0.05", "optimizer_state": "fresh"}


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))


@pytest.fixture(scope="module")
def ref(tc):
    return reference_model(tc)


def tower_in(ref, dtype):
    model, _, tok = ref
    return TextTower.of(copy.deepcopy(model).to(dtype), tok)


def weighted(f: torch.Tensor) -> torch.Tensor:
    """A scalar of every feature with distinct weights (so that a wrong row or column changes the gradient)."""
    w = torch.arange(f.numel(), dtype=f.dtype).view_as(f).mul(0.37).sin()
    return (f * w).sum()


def both_paths(tower, names, n_ctx, ctx, classes=None):
    full = PromptLearner(tower, names, n_ctx)
    shared = PromptLearner(tower, names, n_ctx, shared_prefix=True)
    assert shared.shared_prefix and not full.shared_prefix
    out = []
    for pl in (full, shared):
        c = ctx.detach().clone().requires_grad_(True)
        f = pl.features(c, classes)
        (g,) = torch.autograd.grad(weighted(f), c) if c.numel() else (torch.zeros_like(c),)
        out.append((f.detach(), g))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_ctx", [0, 1, 4, 16])
@pytest.mark.parametrize("K", [1, 3, len(NAMES)])
def test_shared_prefix_features_and_gradients_equal_the_full_path(ref, dtype, n_ctx, K):
    tower = tower_in(ref, dtype)
    g = torch.Generator().manual_seed(10 * n_ctx + K)
    ctx = (torch.randn(3, n_ctx, tower.width, generator=g, dtype=torch.float64) * 0.5).to(dtype)  # 3 clients
    (fa, ga), (fb, gb) = both_paths(tower, NAMES[:K], n_ctx, ctx)
    assert fa.shape == fb.shape == (3, K, 32) and fb.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(fb, fa, atol=tol, rtol=tol)
    torch.testing.assert_close(gb, ga, atol=tol, rtol=tol)
    if n_ctx:
        assert float(ga.abs().max()) > 1e-3  # the gradient compared is not vacuous
        assert not torch.allclose(fa[0], fa[1])  # the clients' contexts differ


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_client_classes_and_cpu_blocks(ref, dtype, monkeypatch):
    """``features(ctx, classes)`` (each client's own class subset) and the CPU's blocks of whole clients."""
    import fedfeat.encoders.prompt as prompt_mod

    tower = tower_in(ref, dtype)
    g = torch.Generator().manual_seed(5)
    ctx = (torch.randn(5, 4, tower.width, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    classes = torch.stack([torch.randperm(len(NAMES), generator=g)[:3] for _ in range(5)])  # [5, 3]
    tol = TOL[dtype]
    for block in (
        prompt_mod.CPU_BLOCK,
        7,
        1,
    ):  # one block; 2 clients of 3 classes a block; one client a block
        monkeypatch.setattr(prompt_mod, "CPU_BLOCK", block)
        for cls in (None, classes):
            (fa, ga), (fb, gb) = both_paths(tower, NAMES, 4, ctx, cls)
            torch.testing.assert_close(fb, fa, atol=tol, rtol=tol)
            torch.testing.assert_close(gb, ga, atol=tol, rtol=tol)


def test_class_specific_contexts_take_the_full_path(ref):
    tower = tower_in(ref, torch.float64)
    full, shared = PromptLearner(tower, NAMES, 4), PromptLearner(tower, NAMES, 4, shared_prefix=True)
    csc = full.init_context(torch.Generator().manual_seed(1), csc=True, std=0.5)[None]  # [1, K, n_ctx, W]
    calls = []
    orig = tower.forward_shared
    tower.forward_shared = lambda *a: calls.append(1) or orig(*a)
    try:
        with torch.no_grad():
            torch.testing.assert_close(shared.features(csc), full.features(csc), atol=0, rtol=0)
            assert not calls  # class-specific: not shared
            shared.features(csc[:, 0])
            assert calls  # unified: shared
    finally:
        del tower.forward_shared


def test_untruncated_prompts(ref):
    tower = tower_in(ref, torch.float64)
    full = PromptLearner(tower, NAMES, 4, truncate=False)
    shared = PromptLearner(tower, NAMES, 4, truncate=False, shared_prefix=True)
    assert shared.suffix.shape[1] == 77 - 5 and shared.shared_prefix
    ctx = full.init_context(torch.Generator().manual_seed(2), std=0.5)[None]
    with torch.no_grad():
        torch.testing.assert_close(shared.features(ctx), full.features(ctx), atol=1e-9, rtol=1e-9)


def test_random_vit_b32_text_tower_float64():
    """open_clip's ViT-B-32 architecture (width 512, 8 heads, 12 layers), random weights, float64."""
    from fedfeat.encoders.openclip import import_open_clip

    oc = import_open_clip()
    torch.manual_seed(0)
    model = oc.create_model("ViT-B-32", pretrained=None, device="cpu").double().eval()
    tower = TextTower.of(model, oc.get_tokenizer("ViT-B-32"))
    ctx = torch.randn(2, 8, tower.width, dtype=torch.float64) * 0.02
    (fa, ga), (fb, gb) = both_paths(tower, ["cat", "great white shark"], 8, ctx)
    torch.testing.assert_close(fb, fa, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(gb, ga, atol=1e-9, rtol=1e-9)
    want = model.encode_text(tower.tokenize(["X X X X X X X X cat."]))  # the full path is encode_text itself
    with torch.no_grad():
        placeholder = tower.embed(tower.tokenize(["X"]))[0, 1]
        got = PromptLearner(tower, ["cat"], 8, shared_prefix=True).features(placeholder.expand(1, 8, -1))
    torch.testing.assert_close(got[0], want.detach(), atol=1e-9, rtol=1e-9)


# ------------------------------------------------------------------------------ training: promptfl, 2 rounds
@pytest.fixture(scope="module")
def store(tc, tmp_path_factory):
    return tiny_encoded_store(tmp_path_factory.mktemp("data"), pixels=True, tc=tc)


# every text-prompt method that has the switch (its Params has ``shared_prefix``), found in the registry: a new one
# is covered by itself; the settings below only make a method small enough for the tiny store
PREFIX_METHODS = sorted(
    n for n, c in REGISTRY.items() if "shared_prefix" in getattr(c.Params, "__dataclass_fields__", {})
)
SMALL = {"promptfl": FAST, "fedopt": {"n_ctx": "2", "batch_size": "8"}}


def test_the_switch_reaches_the_text_prompt_methods():
    assert {"promptfl", "fedtpg", "fedkgcoop", "fedpgp", "promptfolio", "pfedmoap"} <= set(PREFIX_METHODS)


@pytest.mark.parametrize("name", PREFIX_METHODS)
def test_two_rounds_with_shared_prefix_equal_the_run_without(store, name):
    sets = SMALL.get(name, {"batch_size": "8", "n_ctx": "4"})
    if "n_ctx" not in REGISTRY[name].Params.__dataclass_fields__:
        sets = {k: v for k, v in sets.items() if k != "n_ctx"}
    st = FeatureStore.open(store)
    part = make_partition(
        st.labels("train"), "dirichlet-joint", clients=3, alpha=0.5, seed=3, test_labels=st.labels("test")
    )
    data = load_run_data(st, part, local_test="joint")
    data.live = load_live_text(st)
    runs = {}
    for flag in ("false", "true"):
        m = get_method(name, sets | {"shared_prefix": flag})
        assert m.p.shared_prefix is (flag == "true")
        runs[flag] = run_federated(m, data, rounds=2, participation=1.0, seed=1)
        assert m.learner.shared_prefix is (flag == "true")
    (ga, ma), (gb, mb) = runs["false"], runs["true"]
    for k in ga:
        assert ga[k].dtype == torch.float32
        torch.testing.assert_close(gb[k], ga[k], atol=1e-5, rtol=1e-5)
    la, lb = ([r["train_loss"] for r in m if r.get("train_loss") is not None] for m in (ma, mb))
    assert len(la) == len(lb) >= 2
    np.testing.assert_allclose(lb, la, atol=1e-5)
    first = run_federated(get_method(name, sets), data, rounds=0, participation=1.0, seed=1)[0]
    assert any(not torch.allclose(ga[k], first[k]) for k in ga)  # training moved the parameters
