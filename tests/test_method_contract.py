"""The method contract (``fedfeat.methods.base``): every registered method declares its capabilities with their
declared types, a misspelled capability is refused at ``register``, stacking is declared on the method classes
(``stacks``) with a reason where a method does not stack, and hooks read what the engine used (the round's
learning rate, each client's local steps)."""

from __future__ import annotations

import dataclasses
import doctest

import pytest

import fedfeat.methods.base as B
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, Method, register
from fedfeat.methods.base import CAPABILITIES, capabilities, method_table
from fedfeat.methods.linear import FedAvg
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

BUILT_IN = sorted(n for n, c in REGISTRY.items() if c.__module__.startswith("fedfeat.methods."))

# what fedfeat.runs.stack stacked before the contract declared it on the classes
STACKED = {"fedavg", "fedavgm", "fedprox", "fednova", "fedavg-tau-norm", "fedntd", "fed-focal", "ratio-loss",
           "fst-cbdg", "ccvr", "feddf", "fedbe", "creff", "clip2fl"}  # fmt: skip
STACKED |= {"fedadagrad", "fedadam", "fedyogi"}  # issue 35's server optimisers (fedfeat.methods.serveropt)
STACKED |= {"scaffold", "feddyn"}  # issue 35: per-client state in each run's own ctx.state (engine.stacked)


def _ok(typ, v) -> bool:
    """The declared types, checked here independently of ``Capability.accepts``."""
    return {
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str),
        "hook": lambda: v is None or callable(v),
        "names": lambda: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
    }[typ]()


KIND = {
    "uses_labels": "bool", "runs_on": "str", "federated": "bool", "centralized": "bool", "needs_partition": "bool",
    "needs_live_text": "bool", "needs_pixels": "bool", "shardable": "bool", "benchmark_logits": "hook",
    "local_accuracies": "hook", "stacks": "bool", "no_stack_reason": "str", "stack_shape": "names",
    "divergence_hint": "str", "trains_clients": "bool", "dp_client": "bool", "dp_sample": "str",
}  # fmt: skip


def test_every_capability_is_covered_here():
    """A new capability must be added to this test's table of kinds (and so thought about)."""
    assert set(CAPABILITIES) == set(KIND)
    for name, cap in CAPABILITIES.items():
        assert cap.name == name and cap.doc and "\n" not in cap.doc
        assert _ok(KIND[name], cap.default) and cap.accepts(cap.default)
        assert getattr(Method, name) == cap.default  # Method's attribute is the default


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registered_capabilities_have_their_declared_types(name):
    cls = REGISTRY[name]
    caps = capabilities(cls)
    assert list(caps) == list(CAPABILITIES)
    for k, v in caps.items():
        assert _ok(KIND[k], v), (name, k, v)
        assert CAPABILITIES[k].accepts(v)
    assert capabilities(cls(cls.Params())) == caps  # an instance lists its class's
    B.check_capabilities(cls)  # what register checked


def test_stackable_set_is_declared_on_the_classes():
    assert {m for m in REGISTRY if REGISTRY[m].stacks} == STACKED == set(B.stackable())
    for m in BUILT_IN:
        cls = REGISTRY[m]
        if not cls.stacks:
            assert cls.no_stack_reason.strip() and "\n" not in cls.no_stack_reason, m
    rows = {r["name"]: r for r in method_table()}
    assert rows["fedntd"]["stacks"] == "yes" and rows["zeroshot"]["stacks"] == "no"
    assert rows["fedopt"]["capabilities"]["needs_pixels"] is True


def test_shardable_and_stacks_are_not_inherited():
    """A subclass of FedAvg may change its local training: it declares shardable / stacks itself."""

    class Sub(FedAvg):
        name = "contract-sub"

    class Again(FedAvg):
        name = "contract-again"
        shardable = True
        stacks = True

    assert FedAvg.shardable and FedAvg.stacks is True
    # not inherited: Sub starts from the defaults; every other capability is inherited
    assert Sub.shardable is False and Sub.stacks is False and Sub.uses_labels is True
    assert capabilities(Again)["shardable"] is True and Again.stacks is True
    assert REGISTRY["centralized"].shardable is False and REGISTRY["centralized"].stacks is False


def _cls(attrs: dict, base=Method):
    return type("Typo", (base,), {"name": "contract-typo", **attrs})


@pytest.mark.parametrize(
    "attrs, meant",
    [
        ({"needs_live_txt": True}, "needs_live_text"),
        ({"sharable": True}, "shardable"),
        ({"stack": True}, "stacks"),
        ({"uses_label": False}, "uses_labels"),
        ({"run_on": "pixels"}, "runs_on"),
    ],
)
def test_a_misspelled_capability_is_refused_in_one_line(attrs, meant):
    with pytest.raises(FedfeatError) as e:
        register(_cls(attrs))
    msg = str(e.value)
    assert "\n" not in msg and f"did you mean {meant!r}" in msg and repr(next(iter(attrs))) in msg
    assert "contract-typo" not in REGISTRY


def test_a_misspelling_in_a_base_class_is_refused_too():
    Base = type("TypoBase", (Method,), {"needs_pixel": True})
    with pytest.raises(FedfeatError, match="'needs_pixel' of .*TypoBase is not a capability; did you mean"):
        register(_cls({}, Base))


@pytest.mark.parametrize(
    "attrs, what",
    [
        ({"needs_live_text": 1}, "needs_live_text = 1 must be bool"),
        ({"federated": "no"}, "federated = 'no' must be bool"),
        ({"stacks": "yes"}, "stacks = 'yes' must be bool"),
        ({"stack_shape": ["batch_size"]}, "stack_shape = ['batch_size'] must be a tuple of str"),
        ({"benchmark_logits": True}, "benchmark_logits = True must be a method"),
        ({"no_stack_reason": "two\nlines"}, "no_stack_reason must be one line"),
    ],
)
def test_a_capability_of_the_wrong_type_is_refused(attrs, what):
    with pytest.raises(FedfeatError, match=what.replace("[", r"\[").replace("]", r"\]")) as e:
        register(_cls(attrs))
    assert "\n" not in str(e.value)
    assert "contract-typo" not in REGISTRY


def test_plugins_in_todays_attribute_style_still_register():
    """Today's plugins set capabilities as plain attributes, and have attributes of their own."""

    def scores(self, ctx, glob, test_y):
        return []

    cls = _cls({"needs_live_text": True, "runs_on": "cache + live text encoder", "local_accuracies": scores,
                "smoothing_schedule": "cosine", "temperature": 2.0, "_shardable_later": True})  # fmt: skip
    try:
        assert register(cls) is cls
        c = capabilities(cls)
        assert c["needs_live_text"] is True and c["local_accuracies"] is scores and c["stacks"] is False
    finally:
        REGISTRY.pop("contract-typo", None)


def test_capabilities_docstring_example():
    (t,) = doctest.DocTestFinder().find(B.capabilities, globs={"capabilities": capabilities})
    assert t.examples and doctest.DocTestRunner().run(t).failed == 0


# ----------------------------------------------------------------------------------- hooks see what the engine used
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = SynthParams(classes=4, dim=8, train_per_class=20, test_per_class=5, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("mc") / "s.zarr", p, stats=False, log=lambda *_: None)
    return st, make_partition(st.labels("train"), "dirichlet", clients=4, alpha=0.5, seed=1)


class _Seen(FedAvg):
    """FedAvg that records what its hooks are handed: ctx.lr_round, plan.local_steps, and the engine's own."""

    name = "contract-seen"

    def __init__(self, params):
        super().__init__(params)
        self.made, self.at_begin, self.at_agg, self.at_server, self.planned = [], [], [], [], []
        self.stepped: dict = {}  # (round, client) -> steps its loss was taken

    def make_optimizer(self, rnd):
        opt = super().make_optimizer(rnd)
        self.made.append((rnd, opt.lr))  # the optimiser the engine made and stepped with
        return opt

    def local_begin(self, ctx, plan, glob):
        self.at_begin.append((plan.rnd, ctx.lr_round))
        self.planned.append((plan.rnd, plan.clients.tolist(), plan.local_steps.tolist()))
        return {"clients": plan.clients, "rnd": plan.rnd}

    def step_loss(self, ctx, params, batch, local):
        for c in local["clients"][: batch.n].tolist():  # the active clients of this step: one step each
            key = (local["rnd"], c)
            self.stepped[key] = self.stepped.get(key, 0) + 1
        return super().step_loss(ctx, params, batch, local)

    def aggregate(self, ctx, plan, glob, cparams):
        self.at_agg.append((plan.rnd, ctx.lr_round))
        return super().aggregate(ctx, plan, glob, cparams)

    def server_update(self, ctx, plan, old, new):
        self.at_server.append((plan.rnd, ctx.lr_round))
        return new


@pytest.mark.parametrize("engine", ["batched", "loop"])
def test_hooks_read_the_lr_and_steps_the_engine_used(small, engine):
    """lr 0.1, lr_decay 0.5 over 3 rounds: the engine's optimiser has 0.1, 0.05, 0.025 (``0.1 * 0.5 ** (r - 1)``),
    and every hook of round r from local_begin to server_update reads that rate as ``ctx.lr_round``; each client's
    ``plan.local_steps`` is the number of steps its loss was taken (ceil(size / B) per epoch, 2 epochs)."""
    st, part = small
    P = dataclasses.replace(FedAvg.Params(), lr=0.1, lr_decay=0.5, batch_size=7, local_epochs=2, momentum=0.0)
    m = _Seen(P)
    data = load_run_data(st, part)
    run_federated(m, data, rounds=3, participation=0.5, seed=3, engine=engine, kernel="torch")
    want = {1: 0.1, 2: 0.05, 3: 0.025}
    made = dict(m.made)  # the loop engine makes one optimiser per client: all of a round's are equal
    assert {r for r, _ in m.made} == {1, 2, 3} and all(lr == want[r] for r, lr in m.made)
    for seen in (m.at_begin, m.at_agg, m.at_server):
        assert {r for r, _ in seen} == {1, 2, 3}
        assert all(lr == made[r] == pytest.approx(want[r], rel=0, abs=1e-15) for r, lr in seen)
    sizes = (data.offsets[1:] - data.offsets[:-1]).tolist()  # [clients] samples
    for rnd, clients, steps in m.planned:
        for c, s in zip(clients, steps):
            assert m.stepped.get((rnd, c), 0) == s == 2 * -(-sizes[c] // 7)
    # two clients a round, three rounds (the loop engine: one client at a time)
    assert sum(len(c) for _, c, _ in m.planned) >= 6
