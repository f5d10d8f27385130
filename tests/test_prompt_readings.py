"""PromptFL and FedTPG as their authors' code runs them (``fedfeat.methods.promptfl``, ``fedfeat.methods.prompt``): each
reading against a port of the reference code run on the same inputs, on the tiny open_clip model.

* Dassl's per-epoch learning rate (``CosineAnnealingLR`` + ``ConstantWarmupScheduler``, the real torch schedulers);
* PromptFL's training loop (one SGD + scheduler shared by every client and round, unweighted average) and the fresh
  per-client reading, against torch.optim.SGD written out as the code's loop; the scheduler count resumes;
* CPL's per-dataset settings from ``cpl_dataset`` (``fedfeat train --set``);
* FedTPG's per-client classes, per-client optimisers (momentum and cosine kept per client) and unweighted average,
  against its client loop; the open-vocabulary setting (training never sees the novel names, evaluation generates
  the novel classes' prompts); fp16 = OpenAI CLIP's half precision, exactly.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_clip import TINY_NAME, make_tiny_clip, reference_model, run_cli, write_cifar10

from fedfeat.encoders.live import load_live_text
from fedfeat.encoders.prompt import PromptLearner, TextTower
from fedfeat.engine.context import RoundPlan
from fedfeat.engine.data import build_context, load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.prompt import LR_STEPS, PromptFLParams, epoch_lr, resolve_precision
from fedfeat.methods.promptfl import FedTPGParams, generate
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FeatureStore


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))


@pytest.fixture(scope="module")
def store(tc, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    c10 = write_cifar10(root / "cifar-10-batches-py", n_train=120, n_test=30)
    out = tmp_path_factory.mktemp("cache")
    args = ["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", tc.config]
    args += ["--pretrained", tc.weights, "--out", out, "--device", "cpu", "--templates", "cifar"]
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    return out / "cifar10" / f"{TINY_NAME}-tiny.zarr"


@pytest.fixture(scope="module")
def live(store):
    return load_live_text(FeatureStore.open(store))


def run_data(store, live, clients=3, alpha=0.5):
    st = FeatureStore.open(store)
    part = make_partition(st.labels("train"), "dirichlet", clients=clients, alpha=alpha, seed=3)
    data = load_run_data(st, part)
    data.live = live
    return data


def openvocab_data(store, live):
    """10 classes, 2 clients of 3 classes (4 shots: 3 train + 1 validation each), 4 novel classes."""
    st = FeatureStore.open(store)
    part = make_partition(st.labels("train"), "disjoint-classes", clients=2, shots=4, seed=0, n_classes=10)
    data = load_run_data(st, part)
    data.live = live
    return data


def client_rows(data):
    x = F.normalize(data.train_x.float(), dim=-1)
    off = data.offsets.tolist()
    return [(x[off[i] : off[i + 1]], data.train_y[off[i] : off[i + 1]]) for i in range(len(off) - 1)]


# ------------------------------------------------------------------------------------------------ defaults
def test_defaults_are_the_reference_codes():
    p = PromptFLParams()
    assert (p.lr, p.aggregation, p.schedule, p.optimizer_state, p.precision) == (
        0.001, "mean", "cosine-epoch", "carried", "auto",
    )  # fmt: skip
    assert (p.warmup_epochs, p.warmup_lr, p.local_epochs, p.batch_size, p.momentum, p.weight_decay) == (
        1, 1e-5, 5, 32, 0.9, 5e-4,
    )  # fmt: skip
    t = FedTPGParams()
    assert (t.classes, t.precision, t.optimizer_state, t.aggregation, t.schedule, t.lr) == (
        "client", "auto", "per-client", "mean", "cosine", 0.003,
    )  # fmt: skip
    assert resolve_precision(p, "cpu") == torch.float32 and resolve_precision(p, "cuda") == torch.float16
    assert resolve_precision(PromptFLParams(precision="fp16"), "cpu") == torch.float16
    with pytest.raises(FedfeatError, match="not warmup_rounds"):
        get_method("promptfl", {"warmup_rounds": "1"})


# ------------------------------------------------------------------------------------------------ Dassl
class _ConstantWarmup(torch.optim.lr_scheduler.LRScheduler):
    """Dassl.pytorch@c61a1b5 dassl/optim/lr_scheduler.py:10-54, verbatim but for the removed ``verbose``."""

    def __init__(self, optimizer, successor, warmup_epoch, cons_lr, last_epoch=-1):
        self.successor, self.warmup_epoch, self.cons_lr = successor, warmup_epoch, cons_lr
        super().__init__(optimizer, last_epoch)

    def step(self, epoch=None):
        if self.last_epoch >= self.warmup_epoch:
            self.successor.step(epoch)
            self._last_lr = self.successor.get_last_lr()
        else:
            super().step(epoch)

    def get_lr(self):
        if self.last_epoch >= self.warmup_epoch:
            return self.successor.get_last_lr()
        return [self.cons_lr for _ in self.base_lrs]


def dassl_scheduler(opt, max_epoch: int, warmup: int, cons_lr: float):
    """Dassl's build_lr_scheduler for LR_SCHEDULER cosine, WARMUP_TYPE constant, WARMUP_RECOUNT True."""
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, float(max_epoch))
    return _ConstantWarmup(opt, sched, warmup, cons_lr) if warmup > 0 else sched


@pytest.mark.parametrize("E, W", [(5, 1), (3, 2), (4, 0)])
def test_epoch_lr_is_dassls_scheduler_stepped_per_epoch(E, W):
    """The rate of each of 3E + 4 epochs, the scheduler stepped after each (past T_max it climbs back up, as a
    scheduler shared by every client reaches)."""
    p = PromptFLParams(lr=0.002, local_epochs=E, warmup_epochs=W)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=p.lr, momentum=0.9)
    sched = dassl_scheduler(opt, E, W, p.warmup_lr)
    want = []
    for _ in range(3 * E + 4):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [epoch_lr(p, t) for t in range(len(want))]
    assert got == pytest.approx(want, abs=1e-15, rel=1e-12)
    assert want[:W] == [1e-5] * W and want[W] == pytest.approx(0.002)
    # a round schedule (one rate per round) gives other rates inside a round
    assert got[W + 1] < 0.002


# ------------------------------------------------------------------------------------------------ PromptFL's loop
def promptfl_reference(data, live, glob0, p, rounds, shared: bool):
    """PromptFL@da401e7 federated_main.py:176-193 with the trainer's loop (trainers/promptfl.py:279-301): for every
    round, every client in order loads the global context, trains ``MAX_EPOCH`` epochs (one batch each here), the
    scheduler stepping after each epoch; the server averages the clients' contexts unweighted (utils.py:76). One SGD
    and scheduler for everything (``shared``: the code's single local_trainer), or new ones per client per round."""
    learner = PromptLearner(live.tower, data.class_names, p.n_ctx)
    ctx = torch.nn.Parameter(glob0.clone())
    make = lambda: torch.optim.SGD([ctx], lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)  # noqa: E731
    opt = make()
    sched = dassl_scheduler(opt, p.local_epochs, p.warmup_epochs, p.warmup_lr)
    glob = glob0.clone()
    for _ in range(rounds):
        outs = []
        for x, y in client_rows(data):
            if not shared:
                opt = make()
                sched = dassl_scheduler(opt, p.local_epochs, p.warmup_epochs, p.warmup_lr)
            with torch.no_grad():
                ctx.copy_(glob)
            for _ in range(p.local_epochs):
                t = F.normalize(learner.features(ctx[None])[0], dim=-1)
                loss = F.cross_entropy(data.clip_logit_scale * x @ t.T, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            outs.append(ctx.detach().clone())
        glob = torch.stack(outs).mean(0)
    return glob


@pytest.mark.parametrize("state", ["carried", "fresh"])
def test_promptfl_equals_its_code_loop(store, live, state):
    """3 clients of unequal size, 2 rounds of 3 local epochs, one batch per epoch (batch 64 > any client): the
    carried reading steps one scheduler through 18 client-epochs (the rate oscillates), momentum leaks from client to
    client; both engines give the reference's context. A size-weighted average, a fresh optimiser or a round schedule
    would each give another."""
    data = run_data(store, live)
    sizes = np.diff(data.offsets.numpy())
    assert len(set(sizes.tolist())) == 3 and sizes.max() <= 64
    sets = {"n_ctx": "2", "local_epochs": "3", "batch_size": "64", "lr": "0.5", "optimizer_state": state}
    glob0 = run_federated(get_method("promptfl", sets), data, rounds=0, participation=1.0, seed=0)[0]["ctx"]
    want = promptfl_reference(data, live, glob0, get_method("promptfl", sets).p, 2, shared=state == "carried")
    for engine in ("batched", "loop"):
        got = run_federated(
            get_method("promptfl", sets), data, rounds=2, participation=1.0, seed=0, engine=engine
        )
        torch.testing.assert_close(got[0]["ctx"], want, atol=1e-4, rtol=1e-4)
    other = {"carried": "fresh", "fresh": "carried"}[state]
    for alt in ({"aggregation": "size"}, {"optimizer_state": other}, {"schedule": "cosine"}):
        g = run_federated(get_method("promptfl", sets | alt), data, rounds=2, participation=1.0, seed=0)[0]
        assert float((g["ctx"] - want).abs().max()) > 1e-3, alt


@pytest.mark.parametrize(
    "name, sets",
    [("promptfl", {"n_ctx": "2", "local_epochs": "2", "batch_size": "16", "lr": "0.3"}),
     ("fedtpg", {"batch_size": "16", "lr": "0.3"})],
)  # fmt: skip
def test_optimiser_state_resumes_from_a_checkpoint(store, live, name, sets):
    """PromptFL's shared scheduler count and momentum, FedTPG's per-client momentum and round counts: a run resumed
    after round 1 ends where the uninterrupted run does."""
    data = run_data(store, live)
    full, _ = run_federated(get_method(name, sets), data, rounds=3, participation=0.67, seed=1)
    saved = {}

    def keep(rnd, glob, state):
        saved[rnd] = (rnd, copy.deepcopy(glob), copy.deepcopy(state))

    run_federated(get_method(name, sets), data, rounds=3, participation=0.67, seed=1, on_checkpoint=keep,
                  checkpoint_every=1)  # fmt: skip
    if name == "promptfl":  # client-epochs so far: 2 clients a round, 2 epochs each
        assert saved[1][2][LR_STEPS] == 2 * 2 and saved[2][2][LR_STEPS] == 2 * 2 * 2
    else:
        assert int(saved[2][2]["tpg_rounds"].sum()) == 2 * 2
    resumed, _ = run_federated(get_method(name, sets), data, rounds=3, participation=0.67, seed=1,
                               resume=saved[1])  # fmt: skip
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], atol=1e-6, rtol=0)


def test_aggregation_mean_and_size_by_hand():
    """mean: (1 + 3) / 2 = 2; size (1 and 3 samples): (1 + 9) / 4 = 2.5; fp16 averaged in fp32, rounded once."""
    m = get_method("promptfl", {})
    plan = RoundPlan(1, torch.tensor([0, 1]), torch.tensor([1, 3]), torch.tensor([1, 1]), 32, 1)
    ctx = SimpleNamespace(device=torch.device("cpu"))
    cp = {"ctx": torch.tensor([[1.0], [3.0]])}
    assert m.aggregate(ctx, plan, None, cp)["ctx"].tolist() == [2.0]
    assert get_method("promptfl", {"aggregation": "size"}).aggregate(ctx, plan, None, cp)["ctx"].tolist() == [
        2.5
    ]
    h = torch.tensor([[0.1], [0.2]], dtype=torch.float16)  # 0.0999755859375, 0.199951171875
    half = m.aggregate(ctx, plan, None, {"ctx": h})["ctx"]
    assert half.dtype == torch.float16 and half.item() == 0.14990234375  # fp16(0.14986328125)


# ------------------------------------------------------------------------------------------------ CPL settings
def test_cpl_dataset_gives_that_datasets_quantiles_and_explicit_values_win(store, live, monkeypatch):
    cpl = lambda **kw: get_method("promptfl", {"pseudo": "cpl", **kw}).p.cpl_settings()  # noqa: E731
    assert cpl() == (60.0, 0.9)  # CPL's general values
    assert cpl(cpl_dataset="dtd") == (75.0, 0.95) and cpl(cpl_dataset="DTD") == (75.0, 0.95)
    assert cpl(cpl_dataset="FGVCAircraft") == (90.0, 0.97) and cpl(cpl_dataset="cifar100") == (60.0, 0.9)
    assert cpl(cpl_dataset="dtd", conf_quantile="50") == (50.0, 0.95)
    assert cpl(cpl_dataset="eurosat", regular_threshold="0.5") == (75.0, 0.5)
    with pytest.raises(FedfeatError) as e:
        cpl(cpl_dataset="imagenet")
    assert "known: cifar10, cifar100, cub, dtd, eurosat, fgvc-aircraft, flowers102, resisc45, ucf101" in str(
        e.value
    )
    assert "\n" not in str(e.value)
    with pytest.raises(FedfeatError, match="applies to pseudo=cpl only"):
        get_method("promptfl", {"pseudo": "fpl", "cpl_dataset": "dtd"})
    # the pseudo-labeller gets them
    from fedfeat.methods import pseudolabel

    seen = {}
    real = pseudolabel.make_pseudo_labeller

    def spy(how, **kw):
        seen.update(kw)
        return real(how, **kw)

    monkeypatch.setattr(pseudolabel, "make_pseudo_labeller", spy)
    m = get_method("promptfl", {"pseudo": "cpl", "cpl_dataset": "resisc45", "n_ctx": "2"})
    m.setup(build_context(run_data(store, live), m, 0, torch.device("cpu")))
    assert (seen["conf_quantile"], seen["regular_threshold"]) == (90.0, 0.97)


def test_train_takes_cpl_dataset(store, tmp_path):
    base = ["train", "--method", "promptfl", "--store", store, "--clients", "2", "--rounds", "1", "--quiet",
            "--out", tmp_path, "--set", "pseudo=cpl", "--set", "n_ctx=2", "--set", "local_epochs=1"]  # fmt: skip
    r = run_cli(base + ["--set", "cpl_dataset=nope"])
    assert r.exit_code == 2 and "cpl_dataset 'nope' has no CPL settings; known: cifar10" in r.output
    r = run_cli(base + ["--set", "cpl_dataset=dtd", "--name", "d"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert 'cpl_dataset = "dtd"' in (tmp_path / "d" / "config.toml").read_text()


# ------------------------------------------------------------------------------------------------ FedTPG
def fedtpg_reference(data, live, glob0, p, rounds, clients_per_round, classes="client"):
    """FedTPG@f141c29's loop (server.py:137-161, client.py:90-117, model/FedTPG.py:157-205) with one batch per
    client: each client's generator reads its own classes' name features, its CE runs over them (labels relabelled),
    its SGD (momentum buffer, cosine over the rounds) lives across its rounds; the server divides by num_selected."""
    tower = live.tower
    emb = F.normalize(tower.encode(data.class_names), dim=-1)
    rows = client_rows(data)
    bufs, steps = {}, {}
    glob = {k: v.clone() for k, v in glob0.items()}
    for r in range(rounds):
        outs = []
        for c in clients_per_round[r]:
            x, y = rows[c]
            cls = torch.unique(y) if classes == "client" else torch.arange(len(data.class_names))
            learner = PromptLearner(tower, [data.class_names[i] for i in cls], p.n_ctx)
            P = {k: v.clone().requires_grad_(True) for k, v in glob.items()}
            ctx = generate({k: v[None] for k, v in P.items()}, emb[cls], p.depth, p.heads)
            t = F.normalize(learner.features(ctx)[0], dim=-1)
            y_local = torch.searchsorted(cls, y)
            loss = F.cross_entropy(data.clip_logit_scale * x @ t.T, y_local)
            grads = torch.autograd.grad(loss, list(P.values()))
            s = steps.get(c, 0)
            lr = p.lr * 0.5 * (1 + math.cos(math.pi * s / rounds))  # CosineAnnealingLR(T_max=rounds), s steps
            new = {}
            for (k, v), g in zip(P.items(), grads):
                d = g + p.weight_decay * v.detach()
                b = bufs.get((c, k))
                b = d if b is None else p.momentum * b + d
                bufs[(c, k)] = b
                new[k] = v.detach() - lr * b
            steps[c] = s + 1
            outs.append(new)
        glob = {k: torch.stack([o[k] for o in outs]).mean(0) for k in glob}
    return glob


@pytest.mark.parametrize("participation", [1.0, 0.67])
def test_fedtpg_equals_its_code_loop(store, live, participation):
    """3 clients (each with its own subset of the 10 classes), 3 rounds of one step: the generator each client trains
    sees its classes only, its momentum and cosine step count carry over its own rounds (with 2 of 3 clients per
    round the clients' rates differ inside a round); both engines give the reference. classes=all or fresh
    optimisers give another generator."""
    data = run_data(store, live, alpha=0.3)
    held = [len(torch.unique(y)) for _, y in client_rows(data)]
    assert min(held) < 10 and max(np.diff(data.offsets.numpy())) <= 64
    sets = {"batch_size": "64", "lr": "0.5"}
    glob0 = run_federated(get_method("fedtpg", sets), data, rounds=0, participation=1.0, seed=0)[0]
    runs = {e: run_federated(get_method("fedtpg", sets), data, rounds=3, participation=participation, seed=0,
                             engine=e) for e in ("batched", "loop")}  # fmt: skip
    picked = [row["clients"] for row in runs["batched"][1][1:]]
    assert picked == [row["clients"] for row in runs["loop"][1][1:]]
    if participation < 1:
        assert len({tuple(c) for c in picked}) > 1  # the clients' scheduler counts differ
    want = fedtpg_reference(data, live, glob0, get_method("fedtpg", sets).p, 3, picked)
    for e, (got, _) in runs.items():
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4, msg=f"{e} {k}")
    for alt in ({"classes": "all"}, {"optimizer_state": "fresh"}):
        g = run_federated(
            get_method("fedtpg", sets | alt), data, rounds=3, participation=participation, seed=0
        )[0]
        assert max(float((g[k] - want[k]).abs().max()) for k in want) > 1e-3, alt
    if participation == 1.0:  # classes=all is the same loop with every client's vocabulary the whole one
        g = run_federated(get_method("fedtpg", sets | {"classes": "all"}), data, rounds=2, participation=1.0,
                          seed=0)[0]  # fmt: skip
        ref = fedtpg_reference(data, live, glob0, get_method("fedtpg", sets).p, 2, picked[:2], classes="all")
        for k in ref:
            torch.testing.assert_close(g[k], ref[k], atol=2e-5, rtol=1e-4)


def rename_novel(data):
    """The same run with the novel classes' names changed: what training does must not change."""
    other = copy.copy(data)
    novel = set(data.open_vocab.novel.tolist())
    other.class_names = [f"thing {i}" if i in novel else n for i, n in enumerate(data.class_names)]
    return other


@pytest.mark.parametrize(
    "name, sets", [("fedtpg", {}), ("fedtpg", {"classes": "all"}), ("promptfl", {"n_ctx": "2"})]
)
def test_open_vocabulary_training_never_sees_the_novel_names(store, live, name, sets):
    data = openvocab_data(store, live)
    assert len(data.open_vocab.novel) == 4 and [len(c) for c in data.open_vocab.client_classes] == [3, 3]
    sets = {"batch_size": "16", "local_epochs": "2", "lr": "0.5"} | sets
    a, ma = run_federated(get_method(name, sets), data, rounds=2, participation=1.0, seed=0)
    b, mb = run_federated(get_method(name, sets), rename_novel(data), rounds=2, participation=1.0, seed=0)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-4)  # prompt lengths: rounding only
    assert ma[-1]["base_acc"] is not None and 0 <= ma[-1]["test_acc"] <= 100
    assert [r["base_acc"] for r in ma] == [
        r["base_acc"] for r in mb
    ]  # the base classes' prompts are the same


def test_fedtpg_generates_the_novel_classes_prompts_from_their_names(store, live):
    """The open-vocabulary evaluation: the generator reads the novel names and ranks the novel prompts it makes."""
    data = openvocab_data(store, live)
    m = get_method("fedtpg", {"batch_size": "16"})
    ctx = build_context(data, m, 0, torch.device("cpu"))
    m.setup(ctx)
    glob = m.init_global(ctx)
    glob = {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        for k, v in glob.items()
    }
    novel = ctx.open_vocab.novel
    names = [data.class_names[i] for i in novel]
    emb = F.normalize(live.tower.encode(names), dim=-1)  # the novel names only
    c = generate({k: v[None] for k, v in glob.items()}, emb, 0, 4)
    t = F.normalize(PromptLearner(live.tower, names, 4).features(c)[0], dim=-1)
    x = ctx.test_x
    want = novel[(x @ t.T).argmax(1)]
    assert torch.equal(m.predict_classes(ctx, glob, x, novel), want)
    # conditioned on every class name the novel prompts differ: the conditioning is not vacuous
    every = F.normalize(m.text_features(ctx, {k: v[None] for k, v in glob.items()})[0][novel], dim=-1)
    assert float((every - t).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------------ fp16
def test_fp16_tower_is_openai_clips_half_precision(tc):
    """TextTower.cast(fp16) = the model through OpenAI CLIP's convert_weights (open_clip's convert_weights_to_lp),
    CLIP's fp32 LayerNorm and FedTPG's / CoOp's TextEncoder.forward in clip_model.dtype, bit for bit; fp32 differs."""
    from fedfeat.encoders.openclip import import_open_clip

    model, _, tok = reference_model(tc)
    tower = TextTower.of(model, tok)
    names = ["cat", "dog", "sea lion", "aquarium fish", "great white shark"]
    ctx = PromptLearner(tower, names, 4).init_context(torch.Generator().manual_seed(0))
    half = tower.cast(torch.float16)
    with torch.no_grad():
        got = PromptLearner(half, names, 4, truncate=False).features(ctx[None].half())[0]
        f32 = PromptLearner(tower, names, 4, truncate=False).features(ctx[None])[0]
    m = copy.deepcopy(model)
    import_open_clip().model.convert_weights_to_lp(m, torch.float16)

    class LayerNorm(torch.nn.LayerNorm):  # FedTPG@f141c29 clip/model.py:160-166
        def forward(self, x):
            orig_type = x.dtype
            return super().forward(x.type(torch.float32)).type(orig_type)

    for mod in m.modules():
        if isinstance(mod, torch.nn.LayerNorm):
            mod.__class__ = LayerNorm
    dtype = torch.float16  # clip_model.dtype
    tokens = tok([f"X X X X {n}." for n in names])
    with torch.no_grad():  # model/FedTPG.py:87-98 (batch-first here)
        e = m.token_embedding(tokens).type(dtype)
        prompts = torch.cat([e[:, :1], ctx.half()[None].expand(len(names), -1, -1), e[:, 5:]], 1)
        x = prompts + m.positional_embedding.type(dtype)
        x = m.transformer(x, attn_mask=m.attn_mask.to(dtype))
        x = m.ln_final(x).type(dtype)
        want = x[torch.arange(x.shape[0]), tokens.argmax(dim=-1)] @ m.text_projection
    assert got.dtype == torch.float16 and torch.equal(got, want)
    assert float((got.float() - f32).abs().max()) > 1e-3
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the live tower is left as it was


@pytest.mark.parametrize("name", ["fedtpg", "promptfl"])
def test_fp16_runs_on_a_cpu_and_auto_is_fp32_there(store, live, name):
    data = run_data(store, live)
    sets = {"batch_size": "32", "local_epochs": "1"} | ({"n_ctx": "2"} if name == "promptfl" else {})
    g0 = run_federated(
        get_method(name, sets | {"precision": "fp16"}), data, rounds=0, participation=1.0, seed=0
    )[0]
    runs = {e: run_federated(get_method(name, sets | {"precision": "fp16"}), data, rounds=1, participation=1.0,
                             seed=0, engine=e) for e in ("batched", "loop")}  # fmt: skip
    g16, m16 = runs["batched"]
    assert all(v.dtype == torch.float16 and bool(torch.isfinite(v).all()) for v in g16.values())
    assert any(not torch.equal(g16[k], g0[k]) for k in g16) and m16[-1]["train_loss"] > 0
    for k in g16:
        torch.testing.assert_close(runs["loop"][0][k], g16[k], atol=2e-3, rtol=2e-3)
    auto = run_federated(get_method(name, sets), data, rounds=1, participation=1.0, seed=0)[0]
    assert all(v.dtype == torch.float32 for v in auto.values())
    assert max(float((auto[k] - g16[k].float()).abs().max()) for k in g16) > 0  # another reading


def test_promptfl_fpl_select_reaches_the_labeller():
    """``pseudo=fpl`` selects with the FPL code's stream by default and with the exact top-k under
    ``fpl_select=topk``: the rows ``pseudo_label`` keeps are those labellers' own."""
    from types import SimpleNamespace

    from fedfeat.methods import get_method
    from fedfeat.methods import pseudolabel as pl
    from fedfeat.methods.prompt import pseudo_label

    g = torch.Generator().manual_seed(3)
    feats = torch.nn.functional.normalize(torch.randn(60, 8, generator=g), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=-1)
    offsets = torch.tensor([0, 25, 60])
    probs = torch.softmax(30.0 * feats @ text.T, -1)
    got = {}
    for sel in ("stream", "topk"):
        ctx = SimpleNamespace(feats=feats, text=text, clip_logit_scale=30.0, offsets=offsets, state={})
        p = get_method("promptfl", {"pseudo": "fpl", "pseudo_k": "3", "fpl_select": sel}).p
        pseudo_label(ctx, "fpl", p)
        got[sel] = ctx.state["pseudo_rows"].tolist()
        assert got[sel] == pl.FPL(3, select=sel)(probs, offsets).rows.tolist()
    assert got["stream"] != got["topk"]
