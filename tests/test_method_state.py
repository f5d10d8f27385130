"""Every method declares the state it keeps (``Method.state_keys``, merged over the MRO by ``declared_state``):
after two rounds of every registered method -- feature methods on a tiny synthetic store, prompt methods on the tiny
open_clip store of ``tests/helpers_clip.py`` -- every key of ``ctx.state`` is declared by the method or the engine
(``ENGINE_STATE_KEYS``), every declaration has one line of doc, and writing an undeclared key raises a ``KeyError``
that names the method, the key and ``state_keys``.

A new method is covered by enumerating ``REGISTRY``; one that needs settings to run here adds them to ``SETTINGS``.
"""

from __future__ import annotations

import pytest
import torch
from helpers_clip import feature_and_prompt_stores

from fedfeat.engine import data as engine_data
from fedfeat.engine.context import ENGINE_STATE_KEYS, MethodState, state_for
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, LinearHead, Method, get_method, register
from fedfeat.runs.config import RunConfig
from fedfeat.runs.train import train

SETTINGS = {  # method (/variant) -> what it needs to run here, and variants that write other keys
    "fed-mp": {"partition": "disjoint-classes", "clients": 2},
    "ratio-loss": {"params": {"aux_per_class": 5}},
    "feddf": {"imbalance_factor": 10.0, "params": {"val_data": "train"}},
    "fedbe": {"imbalance_factor": 10.0},
    "fedcopl/carried": {"params": {"optimizer_state": "carried"}},  # the engine's carried_optimizer
    "fedtpg/per-client": {"params": {"optimizer_state": "per-client"}},  # per-client momentum
    "promptfl/cpl": {"params": {"pseudo": "cpl"}},  # pseudo_candidates
    "promptfl/fpl": {"params": {"pseudo": "fpl"}},  # pseudo_labels, pseudo_rows
}
KEYS = sorted(set(REGISTRY) | set(SETTINGS))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return feature_and_prompt_stores(tmp_path_factory.mktemp("method-state"))


def test_every_declaration_has_one_line_of_doc():
    for name, cls in REGISTRY.items():
        for key, doc in cls.declared_state().items():
            assert isinstance(doc, str) and doc.strip() and "\n" not in doc, (name, key)
            assert key not in ENGINE_STATE_KEYS, (name, key)
    for key, doc in ENGINE_STATE_KEYS.items():
        assert doc.strip() and "\n" not in doc, key


def test_declarations_merge_over_the_mro():
    """FedTPG adds its per-client momentum to what PromptMethod declares; CLIP2FL its teacher logits to CReFF's."""
    assert set(REGISTRY["promptfl"].declared_state()) < set(REGISTRY["fedtpg"].declared_state())
    assert set(REGISTRY["fedtpg"].declared_state()) - set(REGISTRY["promptfl"].declared_state()) == {
        "tpg_momentum",
        "tpg_rounds",
    }
    assert REGISTRY["clip2fl"].declared_state().keys() - REGISTRY["creff"].declared_state().keys() == {
        "z_clip"
    }
    assert REGISTRY["fedavg"].declared_state() == {}


@pytest.mark.parametrize("key", KEYS)
def test_two_rounds_write_only_declared_keys(stores, key, tmp_path, monkeypatch):
    name = key.split("/")[0]
    cls = REGISTRY[name]
    made: list[MethodState] = []

    def record(method):  # every ctx.state the run makes (build_context's)
        made.append(state_for(method))
        return made[-1]

    monkeypatch.setattr(engine_data, "state_for", record)
    monkeypatch.setattr("fedfeat.report.plots.plot_curves", lambda *a, **k: None)  # not what is checked here
    extra = dict(SETTINGS.get(key, {}))
    params = dict(extra.pop("params", {}))
    prompt = cls.needs_live_text or cls.needs_pixels
    if prompt:
        params.setdefault("batch_size", 8)
    base = dict(method=name, store=str(stores["prompt" if prompt else "feature"]), clients=3, participation=0.67,
                rounds=2, kernel="torch", device="cpu", out=str(tmp_path), name="x")  # fmt: skip
    cfg = RunConfig(**{**base, **extra, "params": params})
    train(cfg, checkpoint_every=1, progress=False, log=lambda s: None)  # round 1's checkpoint packs the state
    assert made, f"{key}: no context was built"
    declared = {**ENGINE_STATE_KEYS, **cls.declared_state()}
    for st in made:
        assert isinstance(st, MethodState) and st.declared == declared
        assert set(st) <= set(declared), f"{key}: undeclared {set(st) - set(declared)}"


def test_an_undeclared_write_raises_naming_method_key_and_where():
    st = state_for(get_method("fedavgm"))
    st["v"] = None
    st.setdefault("round_buffers", {})  # the engine's
    for write in (
        lambda: st.__setitem__("vv", 1),
        lambda: st.setdefault("vv", 1),
        lambda: st.update(vv=1),
        lambda: st.update({"v": 1, "vv": 1}),
    ):
        with pytest.raises(KeyError) as e:
            write()
        msg = str(e.value)
        assert "fedavgm" in msg and "'vv'" in msg and "FedAvgM.state_keys" in msg and "\n" not in msg
    assert "vv" not in st and st["v"] is None  # a refused update writes nothing
    assert st.get("vv") is None and "vv" not in st  # reads stay plain


def test_a_plugin_that_writes_an_undeclared_key_fails_and_one_that_declares_it_runs(tmp_path):
    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import make_partition
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    p = SynthParams(classes=3, dim=8, train_per_class=4, test_per_class=2, templates=1)
    st = write_synthetic_store(tmp_path / "t.zarr", p, stats=False, log=lambda *_: None)
    data = load_run_data(st, make_partition(st.labels("train"), "iid", clients=2, seed=0))

    class Writes(LinearHead):
        name = "test-state-writes"

        def setup(self, ctx):
            ctx.state["seen"] = torch.zeros(ctx.n_clients)

    class Declares(Writes):
        name = "test-state-declares"
        state_keys = {"seen": "per-client: [C] a counter (test)"}

    class Nothing(LinearHead):  # declares nothing, writes nothing: runs
        name = "test-state-nothing"

    try:
        for c in (Writes, Declares, Nothing):
            register(c)
        with pytest.raises(KeyError, match=r"test-state-writes wrote ctx.state\['seen'\].*state_keys"):
            run_federated(get_method("test-state-writes"), data, rounds=1, participation=1.0, seed=0)
        run_federated(get_method("test-state-declares"), data, rounds=1, participation=1.0, seed=0)
        run_federated(get_method("test-state-nothing"), data, rounds=1, participation=1.0, seed=0)
    finally:
        for c in (Writes, Declares, Nothing):
            REGISTRY.pop(c.name, None)


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"x": ""}, "needs one line of doc"),
        ({"x": "two\nlines"}, "needs one line of doc"),
        ({"round_buffers": "mine"}, "is the engine's"),
        (["x"], "must be a dict"),
    ],
)
def test_register_refuses_a_bad_declaration(keys, says):
    class Bad(Method):
        name = "test-state-bad"
        state_keys = keys

    with pytest.raises(FedfeatError, match=says):
        register(Bad)
    assert "test-state-bad" not in REGISTRY
