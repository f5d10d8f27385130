"""Prompt learning through the live text encoder (``fedfeat.encoders.prompt``, ``fedfeat.encoders.live``, ``promptfl``, ``fedtpg``) on the
tiny open_clip model: the learner against open_clip's own ``encode_text``, frozen encoder weights, batched vs loop
engines, the store fingerprint check and its one-line errors, and ``fedfeat train`` end to end."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from helpers_clip import (
    cli_error_text,
    make_tiny_clip,
    reference_model,
    reference_text_features,
    run_cli,
    tiny_encoded_store,
)

from fedfeat.encoders.live import load_live_text
from fedfeat.encoders.prompt import PromptLearner, TextTower
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FeatureStore

NAMES = ["cat", "dog", "sea lion", "aquarium fish", "great white shark"]


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))


@pytest.fixture(scope="module")
def ref(tc):
    return reference_model(tc)


@pytest.fixture(scope="module")
def tower(ref):
    model, _, tok = ref
    return TextTower.of(model, tok)


@pytest.fixture(scope="module")
def store(tc, tmp_path_factory):
    return tiny_encoded_store(tmp_path_factory.mktemp("data"), tc=tc)


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_phrase_context_reproduces_encode_text(ref, tower):
    """Contexts set to the token embeddings of "a photo of a" give open_clip's ``encode_text("a photo of a {c}.")``."""
    model, _, tok = ref
    pl = PromptLearner(tower, NAMES, n_ctx=4)
    ctx = pl.init_context(None, phrase="a photo of a")
    with torch.no_grad():
        got = pl.features(ctx.unsqueeze(0))[0]
        want = model.encode_text(tok([f"a photo of a {c}." for c in NAMES]))
    assert got.shape == (len(NAMES), 32)
    assert float(cos(got, want).min()) >= 0.9999
    # random contexts give other features (the check above is not vacuous)
    rnd = pl.init_context(torch.Generator().manual_seed(0))
    with torch.no_grad():
        other = pl.features(rnd.unsqueeze(0))[0]
    assert float(cos(other, want).max()) < 0.99


def test_zero_context_with_the_store_template_reproduces_the_stored_embeddings(ref, tower, store):
    model, _, tok = ref
    st = FeatureStore.open(store)
    stored = torch.from_numpy(st.text_features().astype(np.float32))  # [T, K, D]
    want = torch.from_numpy(
        reference_text_features(model, tok, [t.replace("{}", "{}") for t in st.templates][:2], st.class_names)
    )
    for t, template in enumerate(st.templates[:2]):
        pl = PromptLearner(tower, st.class_names, 0, template=template)
        with torch.no_grad():
            got = pl.features(torch.zeros(1, 0, tower.width))[0]
        assert float(cos(got, stored[t]).min()) >= 0.999  # the store holds float16
        assert float(cos(got, want[t]).min()) >= 0.9999


def test_truncated_prompts_equal_full_length_and_class_specific_contexts(tower):
    g = torch.Generator().manual_seed(3)
    short, full = PromptLearner(tower, NAMES, 6), PromptLearner(tower, NAMES, 6, truncate=False)
    assert short.suffix.shape[1] < full.suffix.shape[1] == 77 - 7
    ctx = torch.stack([short.init_context(g), short.init_context(g)])  # 2 clients
    with torch.no_grad():
        a, b = short.features(ctx), full.features(ctx)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert a.shape == (2, len(NAMES), 32) and not torch.allclose(a[0], a[1])
    # class-specific contexts: each class its own; equal contexts give the unified result
    csc = short.init_context(g, csc=True)
    assert csc.shape == (len(NAMES), 6, tower.width)
    same = ctx[0].expand(len(NAMES), 6, tower.width).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(short.features(same)[0], a[0], atol=1e-6, rtol=1e-6)
        # batched clients = clients one at a time
        two = torch.stack([csc, csc.flip(0)])
        both = short.features(two)
        torch.testing.assert_close(both[1], short.features(two[1:])[0], atol=1e-6, rtol=1e-6)


def test_too_long_prompt_and_bad_phrase_are_one_line_errors(tower):
    with pytest.raises(FedfeatError, match="does not fit the text tower's 77 tokens.*n_ctx"):
        PromptLearner(tower, ["x " * 40], 40)
    pl = PromptLearner(tower, NAMES, 3)
    with pytest.raises(FedfeatError, match="is 4 tokens but n_ctx = 3; pass --set n_ctx=4"):
        pl.init_context(None, phrase="a photo of a")


# optimizer_state=fresh: PromptFL's default carries one optimiser across clients (its code's reading), which runs the
# clients one after another in both engines; these tests check the batched program (tests/test_prompt_readings.py
# checks the carried reading against PromptFL's loop)
FAST = {"batch_size": "8", "local_epochs": "2", "n_ctx": "4", "lr": "0.05", "optimizer_state": "fresh"}


@pytest.fixture(scope="module")
def live(store):
    return load_live_text(FeatureStore.open(store))


def run_data(store, live, clients=4, alpha=0.3, dtype=torch.float32):
    st = FeatureStore.open(store)
    part = make_partition(st.labels("train"), "dirichlet", clients=clients, alpha=alpha, seed=3)
    data = load_run_data(st, part, dtype=dtype)
    if dtype != torch.float32:  # the live text tower in the same dtype (a copy: the fixture stays float32)
        live = copy.deepcopy(live)
        live.model.to(dtype)
        live.tower = TextTower.of(live.model, live.tower.tokenizer)
    data.live = live
    return data


@pytest.mark.parametrize("name, sets", [("promptfl", {}), ("promptfl", {"csc": "true"}), ("fedtpg", {})])
def test_batched_equals_loop_with_ragged_clients(store, live, name, sets):
    """In float64, so that the comparison sees the programs, not float32 rounding amplified by two rounds of
    lr 0.05 through a transformer (float32 differed by up to 2e-5 on some machines)."""
    data = run_data(store, live, dtype=torch.float64)
    sizes = np.diff(data.offsets.numpy())
    assert len(set(sizes.tolist())) > 1 and any(
        s % 8 for s in sizes
    )  # ragged: unequal sizes, partial batches
    runs = {}
    for engine in ("batched", "loop"):
        m = get_method(name, (FAST if name == "promptfl" else {"batch_size": "8"}) | sets)
        runs[engine] = run_federated(m, data, rounds=2, participation=1.0, seed=1, engine=engine)
    (gb, mb), (gl, ml) = runs["batched"], runs["loop"]
    for k in gb:
        assert gb[k].dtype == torch.float64
        torch.testing.assert_close(gb[k], gl[k], atol=1e-9, rtol=1e-9)
    assert [r["train_loss"] for r in mb] == pytest.approx([r["train_loss"] for r in ml], abs=1e-9)
    assert [r["test_acc"] for r in mb] == pytest.approx([r["test_acc"] for r in ml], abs=1e-9)
    m0 = get_method(name, FAST if name == "promptfl" else {})
    first = run_federated(m0, data, rounds=0, participation=1.0, seed=1)[0]
    assert any(not torch.allclose(gb[k], first[k]) for k in gb)  # training moved the parameters


@pytest.mark.parametrize("name", ["promptfl", "fedtpg"])
def test_a_round_changes_only_the_trainable_parameters(store, live, name):
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    data = run_data(store, live)
    m = get_method(name, FAST if name == "promptfl" else {"batch_size": "8"})
    g0 = run_federated(m, data, rounds=0, participation=1.0, seed=2)[0]
    g1 = run_federated(get_method(m.name, m.p.__dict__), data, rounds=1, participation=1.0, seed=2)[0]
    assert all(not torch.equal(g0[k], g1[k]) for k in g1 if g1[k].numel() > 1)
    after = live.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-identical encoder
    assert not any(p.requires_grad for p in live.model.parameters())


def test_promptfl_learns_on_separable_features(store, live):
    """On features that are a fixed rotation of class text directions, the trained prompts must beat the random
    initial prompts clearly (a method that ignores its gradient would not)."""
    data = run_data(store, live, clients=3, alpha=100.0)
    K = len(data.class_names)
    g = torch.Generator().manual_seed(0)
    centers = torch.nn.functional.normalize(torch.randn(K, data.train_x.shape[1], generator=g), dim=-1)
    data.train_x = centers[data.train_y] + 0.05 * torch.randn(data.train_x.shape, generator=g)
    data.test_x = centers[data.test_y] + 0.05 * torch.randn(data.test_x.shape, generator=g)
    m = get_method(
        "promptfl", {"batch_size": "8", "local_epochs": "5", "n_ctx": "4", "lr": "0.5", "csc": "true"}
    )
    _, metrics = run_federated(m, data, rounds=6, participation=1.0, seed=0)
    assert metrics[-1]["test_acc"] >= metrics[0]["test_acc"] + 25
    assert metrics[-1]["train_loss"] < metrics[1]["train_loss"]


def test_live_encoder_fingerprint_check_refuses_other_weights(tc, store, tmp_path):
    """Weights of the same architecture but another draw: the check's cosine falls below 0.999."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tc.weights))
    g = torch.Generator().manual_seed(9)
    sd = {
        k: (
            v + 0.5 * torch.randn(v.shape, generator=g)
            if "transformer" in k and v.dtype == torch.float32
            else v
        )
        for k, v in sd.items()
    }
    other = tmp_path / "other.safetensors"
    save_file(sd, str(other))
    st = FeatureStore.open(store)
    with pytest.raises(FedfeatError, match="is not the one store .* was encoded with .*sha256"):
        load_live_text(st, pretrained=str(other))
    from fedfeat.encoders import live as live_mod

    with pytest.raises(FedfeatError, match=r"does not reproduce store .*cosine -?0\.\d+ < 0.999"):
        model, _, tok = reference_model(type(tc)(tc.config, other, tc.weights_pt))
        live_mod.fingerprint_check(TextTower.of(model, tok), st)


def test_moved_checkpoint_and_missing_tag_give_encode_style_errors(tc, store, tmp_path):
    moved = tmp_path / "store.zarr"
    shutil.copytree(store, moved)
    zattrs = moved / "zarr.json"
    meta = json.loads(zattrs.read_text())
    meta["attributes"]["weights_file"] = str(tmp_path / "gone" / "tiny.safetensors")
    zattrs.write_text(json.dumps(meta))
    st = FeatureStore.open(moved)
    with pytest.raises(
        FedfeatError, match="no local copy of the weights .* pass --pretrained /path/to/checkpoint"
    ):
        load_live_text(st)
    assert load_live_text(st, pretrained=str(tc.weights)).min_cosine >= 0.999  # the override finds it
    # a store of a tag whose weights are not cached: exactly encode's error (HF_HUB_OFFLINE is set in tests)
    meta["attributes"]["backbone"] = "RN50"
    meta["attributes"]["backbone_config"] = None
    from fedfeat.encoders import backbones, weights

    bb = backbones.resolve_backbone("RN50")
    meta["attributes"]["fingerprint"]["backbone"] = {"name": "RN50", "config_sha256": bb.config_sha256}
    meta["attributes"]["fingerprint"]["weights"] = {"tag": "openai", "source": "x"}
    zattrs.write_text(json.dumps(meta))
    with pytest.raises(FedfeatError) as e:
        load_live_text(FeatureStore.open(moved))
    with pytest.raises(FedfeatError) as e_enc:
        weights.resolve_weights(bb, "openai")
    assert str(e.value) == str(e_enc.value)
    assert "no local copy of the weights for RN50 pretrained 'openai'" in str(e.value) and "\n" not in str(
        e.value
    )


def test_synthetic_store_has_no_encoder(tmp_path):
    synth = tmp_path / "s.zarr"
    r = run_cli(["synth", "--out", synth, "--dim", "16", "--train-per-class", "10", "--test-per-class", "5",
                 "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs"
    r = run_cli(["train", "--method", "promptfl", "--store", synth, "--rounds", "1", "--clients", "2",
                 "--out", out, "--quiet"])  # fmt: skip
    assert r.exit_code == 2
    msg = cli_error_text(r)
    assert "has no encoder to rebuild" in msg and "fedfeat encode" in msg
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.startswith(".lock")]


@pytest.mark.parametrize("method, sets", [("promptfl", ["n_ctx=4"]), ("fedtpg", [])])
def test_train_end_to_end_on_the_tiny_store(store, tmp_path, method, sets):
    args = [
        "train",
        "--method",
        method,
        "--store",
        store,
        "--clients",
        "3",
        "--participation",
        "1",
        "--rounds",
        "2",
    ]
    args += ["--out", tmp_path, "--quiet", "--device", "cpu", "--set", "batch_size=8"]
    for s in sets:
        args += ["--set", s]
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "reproduces the store's text features" in r.output
    (run,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == [0, 1, 2] and rows[1]["train_loss"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["method"] == method
    assert (run / "config.toml").is_file()


class _RefTranslator(torch.nn.Module):
    """FedTPG's ``PromptTranslator`` (``model/prompt_net.py``, depth blocks included) with torch's own modules."""

    def __init__(self, n_ctx, W, D, depth, heads=4, mult=4):
        super().__init__()
        nn = torch.nn

        def ff():
            return nn.Sequential(
                nn.LayerNorm(W), nn.Linear(W, W * mult * 2), _GEGLU(), nn.Linear(W * mult, W)
            )

        self.soft_prompt = nn.Parameter(torch.zeros(n_ctx, W))
        self.norm, self.norm_ctx = nn.LayerNorm(W), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(W, heads, kdim=D, vdim=D, batch_first=True)
        self.ff = ff()
        self.blocks = nn.ModuleList(
            [
                nn.ModuleList([nn.LayerNorm(W), nn.MultiheadAttention(W, heads, batch_first=True), ff()])
                for _ in range(depth)
            ]
        )

    def forward(self, emb):  # emb [1, Kc, D]
        x = self.soft_prompt.unsqueeze(0)
        kv = self.norm_ctx(emb)
        x, _ = self.attn(self.norm(x), kv, kv)
        x = self.ff(x) + x
        for ln, attn, ff in self.blocks:
            h = ln(x)
            x = attn(h, h, h)[0] + x
            x = ff(x) + x
        return x


class _GEGLU(torch.nn.Module):
    def forward(self, x):
        a, g = x.chunk(2, dim=-1)
        return a * torch.nn.functional.gelu(g)


def _load_ref(ref: _RefTranslator, P: dict, depth: int, W: int, D: int) -> None:
    sd = {"soft_prompt": P["soft_prompt"], "norm.weight": P["x_ln_w"], "norm.bias": P["x_ln_b"]}
    sd |= {"norm_ctx.weight": P["x_lnctx_w"], "norm_ctx.bias": P["x_lnctx_b"]}

    def attn(pre, mod, packed):
        out = {}
        if packed:
            out[f"{mod}.in_proj_weight"] = torch.cat([P[pre + "Wq"], P[pre + "Wk"], P[pre + "Wv"]])
        else:
            out |= {f"{mod}.q_proj_weight": P[pre + "Wq"], f"{mod}.k_proj_weight": P[pre + "Wk"]}
            out[f"{mod}.v_proj_weight"] = P[pre + "Wv"]
        out |= {f"{mod}.in_proj_bias": P[pre + "bqkv"], f"{mod}.out_proj.weight": P[pre + "Wo"]}
        out[f"{mod}.out_proj.bias"] = P[pre + "bo"]
        return out

    def ff(pre, mod):
        return {f"{mod}.0.weight": P[pre + "ln_w"], f"{mod}.0.bias": P[pre + "ln_b"], f"{mod}.1.weight": P[pre + "W1"],
                f"{mod}.1.bias": P[pre + "b1"], f"{mod}.3.weight": P[pre + "W2"], f"{mod}.3.bias": P[pre + "b2"]}  # fmt: skip

    sd |= attn("x_", "attn", W == D) | ff("x_ff_", "ff")
    for i in range(depth):
        sd |= {f"blocks.{i}.0.weight": P[f"s{i}_ln_w"], f"blocks.{i}.0.bias": P[f"s{i}_ln_b"]}
        sd |= attn(f"s{i}_", f"blocks.{i}.1", True) | ff(f"s{i}_ff_", f"blocks.{i}.2")
    ref.load_state_dict(sd)


@pytest.mark.parametrize("W, D, depth", [(64, 32, 0), (64, 32, 2), (32, 32, 1)])
def test_fedtpg_generator_equals_the_reference_modules(W, D, depth):
    """The batched functional generator = FedTPG's PromptTranslator built from torch modules, per client."""
    from fedfeat.methods.promptfl import generate, generator_init

    P = generator_init(0, 4, W, D, depth, 4, torch.float64, "cpu")
    assert P["soft_prompt"].std() == pytest.approx(0.02, rel=0.5)
    g = torch.Generator().manual_seed(1)
    clients = [
        {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in P.items()}
        for _ in range(3)
    ]
    emb = torch.nn.functional.normalize(torch.randn(7, D, generator=g, dtype=torch.float64), dim=-1)
    got = generate({k: torch.stack([c[k] for c in clients]) for k in P}, emb, depth, 4)  # [3, 4, W]
    for j, c in enumerate(clients):
        ref = _RefTranslator(4, W, D, depth).double()
        _load_ref(ref, c, depth, W, D)
        with torch.no_grad():
            want = ref(emb.unsqueeze(0))[0]
        torch.testing.assert_close(got[j], want, atol=1e-12, rtol=1e-10)


def test_cpu_blocks_give_the_one_batch_result_and_gradient(tower, monkeypatch):
    import fedfeat.encoders.prompt as prompt_mod

    pl = PromptLearner(tower, NAMES, 3)
    g = torch.Generator().manual_seed(4)
    ctx = torch.stack([pl.init_context(g) for _ in range(3)]).requires_grad_(True)  # 15 prompts
    a = pl.features(ctx)
    (ga,) = torch.autograd.grad(a.square().sum(), [ctx])
    monkeypatch.setattr(prompt_mod, "CPU_BLOCK", 4)  # blocks of 4 prompts cut clients apart
    b = pl.features(ctx)
    (gb,) = torch.autograd.grad(b.square().sum(), [ctx])
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ga, gb, atol=1e-4 * float(ga.abs().max()), rtol=1e-4)  # float32 sums reordered
    assert float(ga.abs().max()) > 0.1


@pytest.mark.parametrize("pseudo", ["fpl", "cpl", "copl"])
def test_unsupervised_promptfl_never_sees_labels_and_batched_equals_loop(store, live, pseudo):
    data = run_data(store, live)
    sets = FAST | {"pseudo": pseudo, "pseudo_k": "3", "conf_quantile": "50", "regular_threshold": "0.5"}
    m = get_method("promptfl", sets)
    assert m.uses_labels is False
    runs = {e: run_federated(get_method("promptfl", sets), data, rounds=2, participation=1.0, seed=1, engine=e)
            for e in ("batched", "loop")}  # fmt: skip
    (gb, mb), (gl, ml) = runs["batched"], runs["loop"]
    torch.testing.assert_close(gb["ctx"], gl["ctx"], atol=1e-5, rtol=1e-5)
    last = mb[-1]
    assert 0 <= last["pseudo_label_acc"] <= 100 and last["pseudo_label_acc"] == ml[-1]["pseudo_label_acc"]
    # at most pseudo_k rows per (client, class): 4 clients x 10 classes x 3 (CoPL: its own budget)
    assert 0 < last["pseudo_samples"] <= (4 * 10 * 3 if pseudo != "copl" else data.offsets[-1])
    if pseudo == "cpl":
        assert last["pseudo_set_size"] >= 1


@pytest.mark.parametrize("pseudo", ["fpl", "copl"])
def test_unsupervised_promptfl_trains_on_exactly_the_selected_rows(store, live, pseudo):
    """The clients' training rows after setup are FPL's (CoPL's) selection of the zero-shot probabilities."""
    from fedfeat.engine.data import build_context
    from fedfeat.methods import pseudolabel as pl
    from fedfeat.methods.copl import CoPL

    data = run_data(store, live)
    m = get_method("promptfl", FAST | {"pseudo": pseudo, "pseudo_k": "2"})
    ctx = build_context(data, m, 0, torch.device("cpu"))
    assert ctx.labels is None
    feats0, seg0 = ctx.feats.clone(), ctx.offsets.clone()
    m.setup(ctx)
    probs = torch.softmax(ctx.clip_logit_scale * feats0 @ ctx.text.T, -1)
    if pseudo == "fpl":
        rows, y = pl.fpl_select(probs, seg0, k=2)
        assert torch.all(ctx.offsets.diff() <= 2 * 10)
    else:  # one-hot labels from CoPL's per-client top-K_{k,c}
        sel = CoPL(round_index=0)(probs, seg0)
        rows, y = sel.rows, sel.candidates.float().argmax(1)
        assert torch.equal(sel.candidates.sum(1), torch.ones(len(rows), dtype=sel.candidates.dtype))
    assert torch.equal(ctx.state["pseudo_rows"], rows) and torch.equal(ctx.state["pseudo_labels"], y)
    assert torch.equal(ctx.feats, feats0[rows])
    assert int(ctx.offsets[-1]) == len(rows) > 0
