"""Differential privacy (issue 41; ``fedfeat.engine.privacy``, ``fedfeat.engine.accountant``).

* client level: fedfeat's DP-FedAvg step equals a transcription of Flower's server-side fixed clipping
  (``flwr.common.differential_privacy`` @ fdef7af) on the same noise; adaptive clipping equals Andrew et al.'s update
  (and Flower's own adaptive rule is shown to move C the other way: the documented reading);
* sample level: the clipped per-sample gradient sums equal a brute-force loop of per-sample autograd calls, for a
  linear head (outer products) and for text prompts (batched vector-Jacobian products through the tiny CLIP tower);
* the accountant's epsilon equals dp-accounting's for the published settings, and a target epsilon calibrates;
* every method that declares a DP level runs it batched = loop (registry-driven), a killed DP run resumes
  bit-identically, and a level a method lacks is refused in one line.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_clip import feature_and_prompt_stores, run_cli, train_killed

from fedfeat.engine import accountant, privacy
from fedfeat.engine.context import Batch
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, get_method
from fedfeat.partition.make import make_partition
from fedfeat.runs.config import RunConfig
from fedfeat.spec import FIELDS
from fedfeat.store.featurestore import FeatureStore

torch.set_default_dtype(torch.float32)
# dp-accounting through fedfeat's import of it (which keeps absl's handler off the test runner's captured stderr)
dpa, rdp, _ = accountant._lib()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return feature_and_prompt_stores(tmp_path_factory.mktemp("dp"))


def _ctx(dp, m=4, seed=3, rnd=2):
    return SimpleNamespace(
        dp=dp, seed=seed, state={"dp": {"clip": dp.clip_norm, "round": {}}}
    ), SimpleNamespace(m=m, rnd=rnd)


# ------------------------------------------------------------------ Flower's DP-FedAvg step, transcribed
def flower_get_norm(arrays):
    return float(np.sqrt(sum(np.linalg.norm(a.flat) ** 2 for a in arrays)))


def flower_clip_inputs_inplace(arrays, clipping_norm):
    factor = min(1, clipping_norm / flower_get_norm(arrays))
    for a in arrays:
        a *= factor


def flower_fixed_clipping_round(current, results, noise_multiplier, clipping_norm, normals):
    """``DifferentialPrivacyServerSideFixedClipping.aggregate_fit`` with FedAvg over equal num_examples and
    ``add_gaussian_noise_inplace``'s ``np.random.normal`` replaced by the given standard normals."""
    clipped = []
    for param in results:
        update = [np.subtract(x, y) for x, y in zip(param, current)]
        flower_clip_inputs_inplace(update, clipping_norm)
        clipped.append([c + u for c, u in zip(current, update)])
    agg = [sum(p[i] for p in clipped) / len(clipped) for i in range(len(current))]
    std = noise_multiplier * clipping_norm / len(results)  # compute_stdv
    return [a + std * n for a, n in zip(agg, normals)]


def test_client_step_equals_flowers_fixed_clipping():
    g = torch.Generator().manual_seed(0)
    glob = {
        "W": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }
    cparams = {
        k: v + 0.3 * torch.randn(4, *v.shape, generator=g, dtype=torch.float64) for k, v in glob.items()
    }
    dp = privacy.DPConfig("client", 0.7, 0.25)
    ctx, plan = _ctx(dp)
    ours = privacy.client_aggregate(ctx, plan, glob, cparams)
    # the same standard normals, in fedfeat's draw order (sorted names, flattened)
    z = privacy.gaussian(
        privacy.rng.stream_key(ctx.seed, plan.rnd, privacy.TAG_DP_CLIENT), torch.zeros(1), 18
    )[0]
    normals = [z[:15].numpy().reshape(3, 5), z[15:].numpy()]  # sorted names: "W" < "b"
    current = [glob["W"].numpy(), glob["b"].numpy()]
    results = [[cparams["W"][i].numpy().copy(), cparams["b"][i].numpy().copy()] for i in range(4)]
    want = flower_fixed_clipping_round(current, results, 0.7, 0.25, normals)
    assert np.allclose(ours["W"].numpy(), want[0], atol=1e-12, rtol=0)
    assert np.allclose(ours["b"].numpy(), want[1], atol=1e-12, rtol=0)
    # a wrong sensitivity (noise not divided by m) is caught
    assert not np.allclose(ours["W"].numpy(), want[0] + 0.7 * 0.25 * 0.75 * normals[0], atol=1e-6)


def test_adaptive_clipping_is_andrew_et_al_and_flowers_rule_runs_the_other_way():
    """Andrew et al. 2021 (TF Privacy's QuantileEstimatorQuery): C <- C exp(-eta (b~ - gamma)), b~ the noised
    fraction of *unclipped* updates. With every update clipped (C far too small), C must grow; Flower @ fdef7af's
    server-side rule counts the *clipped* ones (norm_bit = scaling_factor < 1) and shrinks it."""
    g = torch.Generator().manual_seed(1)
    glob = {"w": torch.zeros(6, dtype=torch.float64)}
    cparams = {"w": torch.randn(8, 6, generator=g, dtype=torch.float64)}  # norms ~ 2.4, C = 0.1: all clipped
    dp = privacy.DPConfig("client", 0.5, 0.1, clip="adaptive")
    ctx, plan = _ctx(dp, m=8)
    privacy.client_aggregate(ctx, plan, glob, cparams)
    sb = 8 / 20
    noise = float(
        privacy.gaussian(privacy.rng.stream_key(3, 2, privacy.TAG_DP_COUNT), torch.zeros(1), 1)[0, 0]
    )
    norms = cparams["w"].norm(dim=1)
    b = (float((norms <= 0.1).sum()) + sb * noise) / 8
    assert ctx.state["dp"]["clip"] == pytest.approx(0.1 * math.exp(-0.2 * (b - 0.5)), rel=1e-12)
    assert ctx.state["dp"]["clip"] > 0.1  # all clipped: C grows
    flower_bit = float((norms > 0.1).sum())  # Flower's norm_bit count
    flower_c = 0.1 * math.exp(-0.2 * ((flower_bit + sb * noise) / 8 - 0.5))
    assert flower_c < 0.1
    # the updates' multiplier: Flower's compute_adaptive_noise_params
    assert dp.update_multiplier(8)[0] == pytest.approx((0.5**-2 - (2 * sb) ** -2) ** -0.5, rel=1e-12)


def test_noise_is_counter_based_and_standard_normal():
    a = privacy.gaussian(123, torch.tensor([0, 5, 9]), 4000)
    b = privacy.gaussian(123, torch.tensor([9]), 4000)
    assert torch.equal(a[2], b[0])  # a client's noise does not depend on who else is drawn
    assert abs(float(a.mean())) < 0.03 and abs(float(a.std()) - 1) < 0.03
    assert not torch.equal(a[0], a[1])


# ------------------------------------------------------------------ per-sample clipping vs brute force
def _brute_head(method, params, batch, clip):
    n, B, _ = batch.x.shape
    sums = {k: torch.zeros_like(v) for k, v in params.items()}
    for c in range(n):
        for i in range(B):
            if not batch.mask[c, i]:
                continue
            p = {k: v[c : c + 1].detach().clone().requires_grad_(True) for k, v in params.items()}
            z = method.logits(p, batch.x[c : c + 1, i : i + 1])
            loss = method.sample_loss(None, z, batch.y[c : c + 1, i : i + 1], {}).sum()
            gr = torch.autograd.grad(loss, list(p.values()))
            norm = math.sqrt(sum(float(x.double().pow(2).sum()) for x in gr))
            f = min(1.0, clip / norm)
            for k, x in zip(p, gr):
                sums[k][c] += f * x[0]
    return sums


@pytest.mark.parametrize("name", ["fedavg", "fed-focal"])
def test_head_per_sample_clipping_equals_brute_force(name):
    torch.manual_seed(0)
    m = get_method(name, {"logit_scale": 10.0})
    n, B, K, D = 3, 5, 4, 6
    params = {"W": torch.randn(n, K, D, dtype=torch.float64), "b": torch.randn(n, K, dtype=torch.float64)}
    x = F.normalize(torch.randn(n, B, D, dtype=torch.float64), dim=-1)
    mask = torch.ones(n, B, dtype=torch.bool)
    mask[2, 3:] = False  # a ragged last batch
    batch = Batch(x, mask, None, n, 0, 0, torch.randint(0, K, (n, B)))
    _, sums = m.dp_clipped_sums(None, params, batch, {}, 0.5)
    want = _brute_head(m, params, batch, 0.5)
    for k in sums:
        assert torch.allclose(sums[k], want[k], atol=1e-12, rtol=0), k
    _, loose = m.dp_clipped_sums(None, params, batch, {}, 1e9)  # no clipping: the plain gradient sums
    assert not torch.allclose(loose["W"], sums["W"], atol=1e-6)


def test_text_per_sample_clipping_equals_brute_force(stores, monkeypatch):
    from fedfeat.methods.promptfl import PromptFL

    seen = []
    orig = PromptFL.setup
    monkeypatch.setattr(PromptFL, "setup", lambda self, ctx: (seen.append((self, ctx)), orig(self, ctx))[1])
    st = FeatureStore.open(stores["prompt"])
    part = make_partition(st.labels("train"), "iid", clients=2)
    data = load_run_data(st, part)
    from fedfeat.encoders.live import load_live_text

    data.live = load_live_text(st)
    run_federated(
        get_method("promptfl", {"n_ctx": 2, "batch_size": 4}), data, rounds=1, participation=1.0, seed=0
    )
    m, ctx = seen[-1]
    ctx.dp = privacy.DPConfig("sample", 1.0, 0.05, vjp_chunk=2)
    torch.manual_seed(1)
    n, B = 2, 3
    c0 = m.init_global(ctx)["ctx"]  # [n_ctx, width]
    params = {"ctx": c0.unsqueeze(0).repeat(n, 1, 1) + 0.01 * torch.randn(n, *c0.shape)}
    x = ctx.feats[: n * B].view(n, B, -1)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    batch = Batch(x, mask, None, n, 0, 0, torch.tensor([[0, 1, 2], [3, 1, 0]]))
    _, sums = m.dp_clipped_sums(ctx, params, batch, {}, 0.05)
    want = torch.zeros_like(params["ctx"])
    norms = []
    for c in range(n):
        for i in range(B):
            if not mask[c, i]:
                continue
            p = {"ctx": params["ctx"][c : c + 1].detach().clone().requires_grad_(True)}
            z = m.logits(ctx, p, x[c : c + 1, i : i + 1])
            loss = F.cross_entropy(z[0], batch.y[c, i : i + 1])
            (gr,) = torch.autograd.grad(loss, [p["ctx"]])
            norms.append(float(gr.norm()))
            want[c] += min(1.0, 0.05 / float(gr.norm())) * gr[0]
    assert max(norms) > 0.05  # the clip binds for some sample
    assert torch.allclose(sums["ctx"], want, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------ the accountant
def test_epsilon_equals_the_librarys_and_calibration_inverts_it():
    # DP-FedAvg (McMahan et al. 2018): 100 of 763,430 users a round, z = 1.0, delta = 1e-9; Abadi et al. 2016's
    # MNIST: q = 0.01, z = 4, 10,000 steps, delta = 1e-5
    for q, z, steps, delta in ((100 / 763430, 1.0, 3000, 1e-9), (0.01, 4.0, 10000, 1e-5)):
        acc = rdp.RdpAccountant()
        acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps))
        assert accountant.epsilon(q, z, steps, delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    tasks = [(0.1, 50), (0.05, 100), (0.1, 20), (0.02, 100)]
    assert accountant.pareto(tasks) == [(0.1, 50), (0.05, 100)]
    eps = [accountant.epsilon(q, 1.2, s, 1e-5) for q, s in tasks]
    assert accountant.worst_epsilon(tasks, 1.2, 1e-5) == pytest.approx(max(eps), rel=1e-12)
    z = accountant.calibrate(tasks, 3.0, 1e-5)
    assert accountant.worst_epsilon(tasks, z, 1e-5) <= 3.0 < accountant.worst_epsilon(tasks, z / 1.01, 1e-5)


# ------------------------------------------------------------------ batched = loop, for every method that has DP
def _feature_data(stores, clients=4):
    st = FeatureStore.open(stores["feature"])
    return load_run_data(st, make_partition(st.labels("train"), "dirichlet", clients=clients, alpha=0.5))


DP_METHODS = sorted(
    (n, mode)
    for n, c in REGISTRY.items()
    for mode in ("client", "sample")
    if (c.dp_client if mode == "client" else c.dp_sample)
)


def test_the_dp_methods_include_the_issues():
    have = set(DP_METHODS)
    assert {("fedavg", "client"), ("fst-cbdg", "client"), ("clip2fl", "client"), ("promptfl", "client"),
            ("fedavg", "sample"), ("fedprox", "sample"), ("promptfl", "sample")} <= have  # fmt: skip


@pytest.mark.parametrize("name,mode", DP_METHODS)
def test_dp_batched_equals_loop(stores, name, mode):
    cls = REGISTRY[name]
    sets = {"crt_epochs": 3, "match_steps": 3} if name in ("creff", "clip2fl") else {}
    if cls.needs_live_text:
        from fedfeat.encoders.live import load_live_text

        st = FeatureStore.open(stores["prompt"])
        data = load_run_data(st, make_partition(st.labels("train"), "iid", clients=2))
        data.live = load_live_text(st)
        sets = {"n_ctx": 2, "batch_size": 8, **({"optimizer_state": "fresh"} if "optimizer_state" in
                                                 cls.Params.__dataclass_fields__ else {})}  # fmt: skip
    else:
        data = _feature_data(stores)
    dp = privacy.DPConfig(mode, 0.8, 0.5 if mode == "sample" else 0.05)
    out = {}
    for engine in ("batched", "loop"):
        out[engine] = run_federated(get_method(name, sets), data, rounds=2, participation=1.0, seed=0,
                                    engine=engine, kernel="torch", dp=dp)  # fmt: skip
    (gb, rb), (gl, rl) = out["batched"], out["loop"]
    for k in gb:
        assert torch.allclose(gb[k].double(), gl[k].double(), atol=1e-5, rtol=0), (name, k)
    assert rb[-1]["epsilon"] == rl[-1]["epsilon"] > 0
    assert [r.get("dp_update_norm", 0.0) for r in rb] == pytest.approx(
        [r.get("dp_update_norm", 0.0) for r in rl], rel=1e-5
    )
    # the noise is there: the same run without DP differs
    plain = run_federated(get_method(name, sets), data, rounds=2, participation=1.0, seed=0, kernel="torch")[
        0
    ]
    assert any(not torch.allclose(gb[k].double(), plain[k].double(), atol=1e-6) for k in gb)


# ------------------------------------------------------------------ resume, refusals, the CLI
def _result(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if "seconds" not in k and not k.startswith("sec_")} for r in rows]
    return rows, (run / "weights.safetensors").read_bytes()


# every privacy setting's examples (``fedfeat.spec``, with their context) on fedavg: a new DP setting is covered by
# itself; then the two levels on methods with more state (FedProx's sample level at a target epsilon, CLIP2FL's
# clipped gradient upload)
RESUME = [
    ("fedavg", {**f.context, k: v}) for k, f in FIELDS.items() if f.part == "privacy" for v in f.examples
]
RESUME += [
    ("fedprox", {"dp": "sample", "epsilon": 5.0}),
    ("clip2fl", {"dp": "client", "noise_multiplier": 1.0}),
]


@pytest.mark.parametrize(
    "method,dp", RESUME, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in d.items())}" for m, d in RESUME]
)
def test_a_killed_dp_run_resumes_bit_identically(stores, tmp_path, method, dp):
    base = dict(method=method, store=str(stores["feature"]), clients=4, participation=0.5, rounds=3, kernel="torch",
                device="cpu", name="x", params={"crt_epochs": 2, "match_steps": 2} if method == "clip2fl" else {},
                **dp)  # fmt: skip
    train_killed(RunConfig(**{**base, "out": str(tmp_path / "a")}), every=0)
    train_killed(RunConfig(**{**base, "out": str(tmp_path / "b")}), every=1, kill=2)
    train_killed(None, every=1, resume=tmp_path / "b" / "x")
    assert _result(tmp_path / "a" / "x") == _result(tmp_path / "b" / "x")
    summary = json.loads((tmp_path / "b" / "x" / "summary.json").read_text())["dp"]
    assert summary["mode"] == dp["dp"] and summary["epsilon"] > 0
    if "epsilon" in dp:
        assert summary["epsilon"] <= dp["epsilon"] and summary["noise_multiplier"] > 0


@pytest.mark.parametrize(
    "args,words",
    [
        (["--method", "fedbe", "--dp", "client", "--epsilon", "4"], "no client-level DP"),
        (["--method", "fst-cbdg", "--dp", "sample", "--epsilon", "4"], "no sample-level DP"),
        (["--method", "fedavg", "--noise-multiplier", "1"], "--dp"),
        (["--method", "fedavg", "--dp", "client"], "--epsilon"),
        (["--method", "fedavg", "--dp", "client", "--epsilon", "2", "--noise-multiplier", "1"], "not both"),
        (["--method", "fedavg", "--dp", "client", "--epsilon", "2", "--delta", "0.5"], "delta"),
        (
            ["--method", "fedavg", "--dp", "sample", "--noise-multiplier", "1", "--kernel", "fused"],
            "--kernel torch",
        ),
        (
            ["--method", "fedavg", "--dp", "sample", "--noise-multiplier", "1", "--delta", "0.05"],
            "training samples",
        ),
        (["--method", "fedavg", "--dp", "client", "--epsilon", "0.01", "--dp-clip", "adaptive"], "below 2 x"),
        (["--method", "fedavg", "--dp", "client", "--epsilon", "1e-9", "--delta", "1e-9"], "above 1e5"),
    ],
)
def test_bad_dp_settings_are_refused_in_one_line(stores, tmp_path, args, words):
    r = run_cli(
        ["train", "--store", stores["feature"], "--clients", "4", "--rounds", "1", "--out", tmp_path, *args]
    )
    assert r.exit_code != 0
    msg = r.output.strip().splitlines()
    assert len(msg) == 1 and words in msg[0], r.output
    assert not list(tmp_path.iterdir())  # nothing written: no run directory, no .partial-, no lock


def test_fixed_point_check():
    with pytest.raises(FedfeatError, match="below 2"):
        privacy.DPConfig("client", 5.0, 0.1, clip="adaptive").update_multiplier(10)


def test_report_shows_the_epsilon_spent(stores, tmp_path):
    for seed in (0, 1):
        r = run_cli(["train", "--store", stores["feature"], "--method", "fedavg", "--clients", "4", "--rounds", "2",
                     "--seed", str(seed), "--dp", "client", "--epsilon", "3", "--delta", "1e-3", "--out", tmp_path,
                     "--quiet"])  # fmt: skip
        assert r.exit_code == 0, r.output
    r = run_cli(["train", "--store", stores["feature"], "--method", "fedavg", "--clients", "4", "--rounds", "2",
                 "--out", tmp_path, "--quiet"])  # fmt: skip
    assert r.exit_code == 0, r.output
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/summary.json"))]
    spent = [d["epsilon"] for d in summaries if "dp" in d]
    assert len(spent) == 2 and all(0 < e <= 3 for e in spent)
    text = run_cli(["report", str(tmp_path)]).output
    assert "epsilon (delta)" in text and f"{spent[0]:.2f} (0.001)" in text
    assert "| -" in text.split("epsilon (delta)")[1]  # the non-private run: "-"
    seeds = run_cli(["report", str(tmp_path), "--seeds"]).output
    assert "epsilon (DP)" in seeds and f"{sum(spent) / 2:.2f}" in seeds
    # the privacy-utility figure: accuracy against the epsilon spent, the non-private run as the method's line
    from fedfeat.report.tables import privacy_groups

    (g,) = privacy_groups(summaries)
    accs = [d["final_acc"] for d in summaries if "dp" in d]
    assert g["points"] == [(pytest.approx(sum(spent) / 2), pytest.approx(sum(accs) / 2), pytest.approx(
        float(np.std(accs, ddof=1))), 2)]  # fmt: skip
    assert g["plain"] == next(d["final_acc"] for d in summaries if "dp" not in d)
    fig = tmp_path.parent / f"{tmp_path.name}-privacy.png"
    r = run_cli(["report", str(tmp_path), "--plot", str(fig), "--kind", "privacy"])
    assert r.exit_code == 0 and fig.stat().st_size > 1000, r.output


def test_an_epsilon_sweep_is_one_stacked_program(stores, tmp_path):
    """Client-level DP runs that differ in their privacy settings stack (the settings are per run): the sweep over
    epsilon costs one program; each run equals itself made alone (``tests/test_spec_stacking.py`` checks that for
    every setting's examples)."""
    from fedfeat.runs.sweep import run_sweep

    base = dict(method="fedavg", store=str(stores["feature"]), clients=4, participation=0.5, rounds=2,
                kernel="torch", dp="client", delta=1e-3)  # fmt: skip
    points = [({**base, "epsilon": e, "out": str(tmp_path)}, {}) for e in (8.0, 2.0)]
    points.append(({**base, "dp": None, "delta": None, "out": str(tmp_path)}, {}))
    made = run_sweep(points, stack=True, progress=False, log=lambda *a: None, failures=[])
    summaries = [json.loads((p / "summary.json").read_text()) for p in made]
    assert [s.get("stacked_runs") for s in summaries] == [3, 3, 3]
    assert summaries[0]["epsilon"] <= 8.0 and summaries[1]["epsilon"] <= 2.0 and "epsilon" not in summaries[2]
    assert summaries[0]["dp"]["noise_multiplier"] < summaries[1]["dp"]["noise_multiplier"]


def test_personal_parts_stay_with_their_clients_under_client_dp(stores, monkeypatch):
    """FedPGP's low-rank factors never leave their clients: under DP-FedAvg the engine aggregates only the global
    prompt and the method keeps each client's own factors (``keep_local``), as it does without DP."""
    from helpers_clip import grab_setups

    from fedfeat.encoders.live import load_live_text
    from fedfeat.methods.prompt_personal import FedPGP

    seen = grab_setups(monkeypatch, [FedPGP])
    st = FeatureStore.open(stores["prompt"])
    data = load_run_data(st, make_partition(st.labels("train"), "iid", clients=2))
    data.live = load_live_text(st)
    sets = {"n_ctx": 2, "batch_size": 8}
    runs = {}
    for dp in (
        None,
        privacy.DPConfig("client", 0.0, 1e9),
    ):  # no noise, no clipping: DP-FedAvg = uniform FedAvg
        start = {k: None for k in ("client_U", "client_V")}
        glob, _ = run_federated(get_method("fedpgp", {**sets, "aggregation": "mean"}), data, rounds=2,
                                participation=1.0, seed=0, dp=dp)  # fmt: skip
        ctx = seen[-1]
        runs[dp is None] = (glob, {k: ctx.state[k].clone() for k in start})
    (g_dp, s_dp), (g, s) = runs[False], runs[True]
    for k in s:
        assert torch.allclose(s_dp[k], s[k], atol=1e-6), k  # the same personal parts, kept
    assert torch.allclose(g_dp["ctx"], g["ctx"], atol=1e-6)
