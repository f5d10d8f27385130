"""``fedcopl`` end to end on the tiny open_clip ViT with a pixel store: batched = loop, partial aggregation (visual
prompts shared, text contexts personal), local test accuracy from each client's own model, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers_clip import TINY_NAME, cli_error_text, make_tiny_clip, run_cli, write_cifar10

from fedfeat.encoders.live import load_live_text
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.methods import get_method
from fedfeat.partition.make import make_partition
from fedfeat.store.featurestore import FeatureStore

FAST = {
    "pseudo": "fpl",
    "pseudo_k": "4",
    "local_epochs": "2",
    "batch_size": "8",
    "refresh": "1",
    "n_ctx": "4",
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("copl")
    tc = make_tiny_clip(d / "tiny")
    fx = write_cifar10(d / "data" / "cifar-10-batches-py", n_train=120, n_test=40)
    out = {}
    for tag, extra in (("px", ["--pixels"]), ("plain", [])):
        r = run_cli(["encode", "--dataset", "cifar10", "--root", fx.root, "--backbone", tc.config, "--pretrained",
                     tc.weights, "--out", d / tag, "--device", "cpu", *extra])  # fmt: skip
        assert r.exit_code == 0, (r.output, r.exception)
        out[tag] = d / tag / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    return out


def _data(store):
    st = FeatureStore.open(store)
    part = make_partition(
        st.labels("train"), "dirichlet-joint", clients=3, alpha=0.5, test_labels=st.labels("test")
    )
    data = load_run_data(st, part, local_test="joint")
    data.live = load_live_text(st)
    return data


@pytest.mark.parametrize(("aggregate", "pseudo"), [("visual", "fpl"), ("both", "fpl"), ("visual", "copl")])
def test_batched_equals_loop_and_partial_aggregation(stores, aggregate, pseudo):
    data = _data(stores["px"])
    runs = {}
    for engine in ("batched", "loop"):
        m = get_method("fedcopl", FAST | {"aggregate": aggregate, "pseudo": pseudo})
        g, rows = run_federated(m, data, rounds=2, participation=1.0, seed=0, engine=engine)
        runs[engine] = (g, rows, {k: v.clone() for k, v in m_state(m).items()})
    (gb, mb, sb), (gl, ml, sl) = runs["batched"], runs["loop"]
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    for k in sb:
        torch.testing.assert_close(sb[k], sl[k], atol=1e-5, rtol=1e-5)
    assert [r["train_loss"] for r in mb] == pytest.approx([r["train_loss"] for r in ml], abs=1e-5)
    assert [r["local_acc"] for r in mb] == pytest.approx([r["local_acc"] for r in ml], abs=1e-9)
    if aggregate == "visual":
        assert set(gb) == {"vpt"}
        text = sb["client_text"]  # [3, n_ctx, W]: personal, trained apart
        assert not torch.allclose(text[0], text[1])
    else:
        assert set(gb) == {"vpt", "text"} and not sb
    assert mb[-1]["pseudo_label_acc"] is not None and 0 < mb[-1]["pseudo_samples"] <= (
        3 * 10 * 4 if pseudo == "fpl" else 120
    )


_STATE = {}


def m_state(m):
    return (
        {k: v for k, v in _STATE.pop("ctx").state.items() if k.startswith("client_")}
        if "ctx" in _STATE
        else {}
    )


@pytest.fixture(autouse=True)
def _capture_ctx(monkeypatch):
    from fedfeat.methods import fedcopl

    orig = fedcopl.FedCoPL.setup

    def setup(self, ctx):
        _STATE["ctx"] = ctx
        return orig(self, ctx)

    monkeypatch.setattr(fedcopl.FedCoPL, "setup", setup)


def test_a_round_trains_only_the_prompts(stores):
    """After a round the encoder is bit-identical and frozen; the visual prompt and every client's text context
    moved."""
    data = _data(stores["px"])
    before = {k: v.clone() for k, v in data.live.model.state_dict().items()}
    m = get_method("fedcopl", FAST)
    g, _ = run_federated(m, data, rounds=1, participation=1.0, seed=0)
    ctx = _STATE.pop("ctx")
    assert all(torch.equal(before[k], v) for k, v in data.live.model.state_dict().items())
    assert not any(p.requires_grad for p in data.live.model.parameters())
    assert not torch.allclose(g["vpt"], m.init["vpt"])
    moved = (ctx.state["client_text"] - m.init["text"]).abs().flatten(1).amax(1)
    assert bool((moved > 0).all())


def test_local_accuracy_is_each_clients_own_model(stores):
    """local_acc = mean over clients of the accuracy of (global visual prompt, the client's own text context) on
    its local test rows, recomputed here from the method's encoders."""
    data = _data(stores["px"])
    m = get_method("fedcopl", FAST)
    g, rows = run_federated(m, data, rounds=1, participation=1.0, seed=0)
    ctx = _STATE.pop("ctx")
    accs = []
    for k, r in enumerate(ctx.local_test):
        if len(r) == 0:
            continue
        logits = m._client_logits(
            ctx, g, ctx.cache["test_pixels"][r], torch.full((len(r),), k, dtype=torch.int64)
        )
        accs.append(float((logits.argmax(1) == data.test_y[r]).double().mean()) * 100)
    assert rows[-1]["local_acc"] == pytest.approx(np.mean(accs), abs=1e-9)


def test_train_end_to_end_and_a_store_without_pixels(stores, tmp_path):
    base = ["train", "--method", "fedcopl", "--partition", "dirichlet-joint", "--alpha", "0.5", "--clients", "3",
            "--participation", "1", "--rounds", "2", "--local-test", "joint", "--quiet", "--device", "cpu"]  # fmt: skip
    sets = [x for k, v in FAST.items() for x in ("--set", f"{k}={v}")]
    r = run_cli([*base, *sets, "--store", stores["px"], "--out", tmp_path / "ok"])
    assert r.exit_code == 0, (r.output, r.exception)
    (run,) = [p for p in (tmp_path / "ok").iterdir() if not p.name.startswith(".")]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == [0, 1, 2] and rows[-1]["local_acc"] is not None
    bad = run_cli([*base, *sets, "--store", stores["plain"], "--out", tmp_path / "bad"])
    assert bad.exit_code == 2
    assert "its store needs pixels; encode it with `fedfeat encode ... --pixels`" in cli_error_text(bad)


@pytest.mark.parametrize("method", ["fedcopl"])
def test_torchrun_two_gloo_ranks_equal_one_process(stores, tmp_path, method):
    """torchrun --nproc-per-node 2 (gloo): each rank trains half of the round's clients, the ranks all-gather them,
    rank 0 alone writes the run; metrics and weights equal one process's."""
    import subprocess
    import sys

    from helpers_clip import REPO, subprocess_env
    from safetensors.torch import load_file

    sets = FAST if method == "fedcopl" else {"n_ctx": "4", "batch_size": "8", "local_epochs": "2"}
    args = ["train", "--method", method, "--store", str(stores["px"]), "--partition", "dirichlet-joint", "--alpha",
            "0.5", "--clients", "3", "--participation", "1", "--rounds", "2", "--local-test", "joint", "--quiet",
            "--device", "cpu", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]  # fmt: skip
    env = subprocess_env(OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "fedfeat", *args, "--out", str(tmp_path / "one")], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run([*launcher, "-m", "fedfeat", *args, "--out", str(tmp_path / "two")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-6000:]
    (a,) = [p for p in (tmp_path / "one").iterdir() if not p.name.startswith(".")]
    (b,) = [p for p in (tmp_path / "two").iterdir() if not p.name.startswith(".")]
    assert a.name == b.name and sorted(x.name for x in a.iterdir()) == sorted(x.name for x in b.iterdir())
    ra = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    for key in ("test_acc", "train_loss", "local_acc"):
        assert [r[key] for r in ra] == pytest.approx([r[key] for r in rb], abs=1e-5), key
    wa, wb = load_file(str(a / "weights.safetensors")), load_file(str(b / "weights.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def synth_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "s.zarr"
    r = run_cli(["synth", "--out", out, "--dim", "32", "--train-per-class", "60", "--test-per-class", "20",
                 "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("pseudo", ["fpl", "copl"])
def test_copl_linear_batched_equals_loop_and_fused_equals_torch(synth_store, pseudo):
    st = FeatureStore.open(synth_store)
    part = make_partition(st.labels("train"), "dirichlet", clients=10, alpha=0.5)
    data = load_run_data(st, part)
    sets = {"pseudo": pseudo, "refresh": "2", "pseudo_k": "5"}
    runs = {}
    for engine, kernel in (("batched", "torch"), ("loop", "torch"), ("batched", "fused")):
        m = get_method("copl-linear", sets)
        assert m.uses_labels is False
        runs[(engine, kernel)] = run_federated(m, data, rounds=3, participation=0.5, seed=0, engine=engine,
                                               kernel=kernel)  # fmt: skip
    (gb, mb), (gl, ml), (gf, mf) = runs.values()
    for g in (gl, gf):
        for k in gb:
            torch.testing.assert_close(gb[k], g[k], atol=1e-5, rtol=1e-5)
    assert [r.get("pseudo_label_acc") for r in mb] == [r.get("pseudo_label_acc") for r in ml]
    from fedfeat.methods.copl import CoPL
    from fedfeat.methods.pseudolabel import fpl_select

    text = torch.nn.functional.normalize(data.text_all[0], dim=-1)
    probs = torch.softmax(
        data.clip_logit_scale * torch.nn.functional.normalize(data.train_x.float(), dim=-1) @ text.T, -1
    )
    # round 1: the head is the text features, zero-shot CLIP
    if pseudo == "fpl":
        rows, y = fpl_select(probs, data.offsets, k=5)
        assert mb[1]["pseudo_samples"] <= 10 * 10 * 5
    else:
        sel = CoPL(round_index=0)(probs, data.offsets)
        rows, y = sel.rows, sel.candidates.float().argmax(1)
        assert mb[1]["pseudo_samples"] == len(rows)
    assert mb[1]["pseudo_label_acc"] == pytest.approx(100 * float((y == data.train_y[rows]).double().mean()))
    # refreshed at round 3 from the trained head: another selection than round 1's
    assert (
        mb[3]["pseudo_label_acc"] != mb[1]["pseudo_label_acc"]
        or mb[3]["pseudo_samples"] != mb[1]["pseudo_samples"]
    )
