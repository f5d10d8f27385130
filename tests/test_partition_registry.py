"""The partition scheme registry (``fedfeat.partition.registry``): every registered scheme, whatever it is, draws, has
a key that tells its parameter sets apart and reads back in words, documents its parameters, fills its defaults and
refuses the parameters of the others. A new scheme in ``fedfeat/partition/kinds/`` is covered here without editing
this file."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import fedfeat.partition as P
from fedfeat.errors import FedfeatError
from fedfeat.partition import registry as R
from fedfeat.partition.schemes import SCHEMES as SCHEMES_FROM_SCHEMES
from fedfeat.report.plots import readable_partition

LABELS = np.random.RandomState(0).permutation(np.repeat(np.arange(20), 30))  # 20 classes x 30 samples
TEST_LABELS = np.random.RandomState(1).permutation(np.repeat(np.arange(20), 8))
CLIENTS = (10, 5, 4, 2, 20)  # the first that a scheme can draw with is used
# schemes that draw by domain (needs_domains) get 5 domains, rows dealt round-robin; "sketch" is a field example
DOMAIN_NAMES = ("clipart", "infograph", "painting", "real", "sketch")
DOMAINS = np.arange(len(LABELS)) % 5
TEST_DOMAINS = np.arange(len(TEST_LABELS)) % 5


def _example(f) -> object:
    return R.field_kind(f)(f.metadata["example"])


def _draw(name: str, **extra):
    """A partition of LABELS with the scheme's filled defaults and the first client count it can take."""
    cls = P.get_scheme(name)
    kw = P.fill_defaults(name, {})
    if cls.uses_test_labels:
        kw["test_labels"] = TEST_LABELS
    if cls.uses_domains:
        kw.update(domains=DOMAINS, test_domains=TEST_DOMAINS, domain_names=DOMAIN_NAMES)
    errors = []
    for clients in CLIENTS:
        try:
            return P.make_partition(LABELS, name, clients=clients, **kw, **extra)
        except FedfeatError as e:
            errors.append(str(e))
    pytest.fail(f"{name}: no client count in {CLIENTS} draws on LABELS: {errors}")


@pytest.fixture(params=list(P.SCHEMES))
def scheme(request):
    return request.param


def test_schemes_keep_their_order_and_import_path():
    assert list(P.SCHEMES)[:6] == ["iid", "shard", "dirichlet", "dirichlet-equal", "disjoint-classes",
                                   "dirichlet-joint"]  # fmt: skip
    assert SCHEMES_FROM_SCHEMES is P.SCHEMES and "iid" in P.SCHEMES
    orders = [cls.order for cls in P.SCHEMES.values()]
    assert orders == sorted(orders)


def test_every_scheme_draws_and_records(scheme):
    cls = P.get_scheme(scheme)
    p = _draw(scheme)
    assert p.scheme == scheme and p.params["scheme"] == scheme
    assert p.params["seed"] == cls.default_seed(None) == P.default_seed(scheme)
    flat = np.concatenate(p.clients)
    assert len(np.unique(flat)) == len(flat) and flat.max() < len(LABELS)
    for f in cls.fields():  # the filled defaults (or the field defaults) are recorded under the field's name
        if (
            f.name in p.params
        ):  # (None: a field whose default is None, e.g. domain's alpha at one client per domain)
            assert p.params[f.name] is not None or f.default is None
    if cls.needs_test_labels:
        assert "test_clients" in p.params


def test_every_parameter_is_documented(scheme):
    cls = P.get_scheme(scheme)
    assert cls.summary and cls.source and "\n" not in cls.summary
    for f in cls.fields():
        assert f.metadata["help"].strip() and f.metadata["example"].strip(), f.name
        assert R.field_kind(f) in (int, float, str)
        check = f.metadata.get("check")  # the range check of the run specification: the example passes it
        assert check is None or check(_example(f)) is None
        assert f.name in {k.name for k in cls.key_parts}, f"{scheme}: {f.name} is not in the key"
    assert P.fill_defaults(scheme, {}) == {**cls.store_defaults}
    given = {f.name: _example(f) for f in cls.fields()}
    assert P.fill_defaults(scheme, given) == given  # given values are kept


def test_keys_tell_parameter_sets_apart_and_read_back(scheme):
    cls = P.get_scheme(scheme)
    p = _draw(scheme)
    key = P.partition_key(p)
    assert key.startswith(scheme + "-")
    other_seed = P.partition_key({**p.params, "seed": p.params["seed"] + 1})
    assert other_seed != key
    for f in cls.fields():  # another value of each parameter: another key
        now = p.params.get(f.name)
        other = _example(f) if now is None else (now + 1 if R.field_kind(f) is int else now * 2)
        assert P.partition_key({**p.params, f.name: other}) != key, f.name
    parsed = R.parse_key(key)
    assert (
        parsed["cls"] is cls and parsed["scheme"] == scheme and parsed["clients"] == str(p.params["clients"])
    )
    for part in cls.key_parts:
        if p.params.get(part.name) is not None:
            assert parsed["values"][part.name] == part.text(p.params[part.name])
    words = readable_partition(key)
    assert words != key and f"{p.params['clients']} clients" in words
    assert "seed" not in words  # the default seed is not named
    assert "seed 12345" in readable_partition(P.partition_key({**p.params, "seed": 12345}))


def test_other_schemes_parameters_do_not_apply(scheme):
    cls = P.get_scheme(scheme)
    own = {f.name for f in cls.fields()}
    for name, f in P.scheme_fields().items():
        if name in own:
            continue
        with pytest.raises(FedfeatError, match=f"{name} does not apply to scheme '{scheme}'") as e:
            P.make_partition(LABELS, scheme, clients=10, **{name: _example(f)})
        assert "\n" not in str(e.value) and all(u in str(e.value) for u in P.schemes_using(name))


def test_inputs_the_scheme_cannot_use_are_refused(scheme):
    cls = P.get_scheme(scheme)
    kw = P.fill_defaults(scheme, {})
    if cls.needs_test_labels:
        with pytest.raises(FedfeatError, match="test"):
            P.make_partition(LABELS, scheme, clients=10, **kw)
    if not cls.takes_imbalance:
        with pytest.raises(FedfeatError, match="imbalance"):
            P.make_partition(LABELS, scheme, clients=10, imbalance_factor=10, test_labels=TEST_LABELS, **kw)


def test_unknown_names_are_one_line_listing_the_known():
    with pytest.raises(FedfeatError) as e:
        P.make_partition(LABELS, "iid", clients=2, alhpa=0.5)
    assert "alhpa" in str(e.value) and all(n in str(e.value) for n in P.scheme_fields())
    with pytest.raises(FedfeatError) as e:
        P.get_scheme("fedavg")
    assert ", ".join(P.SCHEMES) in str(e.value)
    with pytest.raises(FedfeatError, match="pass imbalance_factor with any scheme"):
        P.fill_defaults("longtail", {})
    with pytest.raises(FedfeatError, match="shards must be an integer"):
        P.make_partition(LABELS, "shard", clients=10, shards=2.0)
    with pytest.raises(FedfeatError, match="alpha must be a number"):
        P.make_partition(LABELS, "dirichlet", clients=10, alpha="0.5")


def test_scheme_fields_union_and_users():
    fields = P.scheme_fields()
    assert list(fields)[:4] == ["shards", "alpha", "min_size", "shots"]
    assert P.schemes_using("alpha") == ["dirichlet", "dirichlet-equal", "dirichlet-joint", "domain"]
    assert P.schemes_using("min_size") == ["dirichlet"] and P.schemes_using("nothing") == []
    for name, f in fields.items():  # every scheme that declares a name agrees on its type and help
        for user in P.schemes_using(name):
            g = next(x for x in P.get_scheme(user).fields() if x.name == name)
            assert R.field_kind(g) is R.field_kind(f) and g.metadata["help"] == f.metadata["help"]
    assert P.fill_defaults("dirichlet", {"alpha": None, "shards": None}) == {"alpha": 0.1, "shards": None}
    assert P.fill_defaults("dirichlet-equal", {})["alpha"] == 0.5 and P.fill_defaults("shard", {}) == {
        "shards": 2
    }
    assert P.fill_defaults("disjoint-classes", {}) == {"shots": 10} and P.fill_defaults("iid", {}) == {}


def test_keys_of_the_first_six_are_as_before():
    """The key format of before the registry, byte for byte (keys name stored partitions)."""
    cases = {
        "iid-c100-s19940817": {"scheme": "iid", "clients": 100, "seed": 19940817, "alpha": None},
        "shard-sh2-c10-s19940817": {"scheme": "shard", "shards": 2, "clients": 10, "seed": 19940817},
        "dirichlet-a0.1-c100-s19940817-m1": {"scheme": "dirichlet", "alpha": 0.1, "clients": 100,
                                             "seed": 19940817, "min_size": 1},
        "lt100+dirichlet-equal-a0.5-c20-s7": {"scheme": "dirichlet-equal", "alpha": 0.5, "clients": 20,
                                              "imbalance_factor": 100.0, "seed": 7},
        "disjoint-classes-shot16-c10-s0-ocaltech101": {"scheme": "disjoint-classes", "shots": 16, "clients": 10,
                                                       "seed": 0, "class_order": "caltech101"},
        "dirichlet-joint-a0.3-c10-s2": {"scheme": "dirichlet-joint", "alpha": 0.3, "clients": 10, "seed": 2},
        "custom-sh3-a2-c4-s1-m5": {"scheme": "custom", "alpha": 2, "shards": 3, "clients": 4, "seed": 1,
                                   "min_size": 5},  # a name no scheme has: every scheme's parts, in order
    }  # fmt: skip
    for key, params in cases.items():
        assert P.partition_key(params) == key
    assert readable_partition("dirichlet-a0.1-c100-s19940817-m1") == "Dir(α = 0.1), 100 clients, min size 1"
    assert readable_partition("disjoint-classes-shot16-c10-s0-ocaltech101") == (
        "disjoint classes, 16 shots, 10 clients, caltech101 class order"
    )


@pytest.fixture
def clean_registry():
    before = dict(P.SCHEMES)
    yield
    P.SCHEMES.clear()
    P.SCHEMES.update(before)


def test_a_new_scheme_is_one_class(clean_registry):
    """A scheme registered anywhere (here: in a test) is in SCHEMES after the built-in ones, draws, keys and reads."""

    @R.register_scheme
    class EveryOther(R.Scheme):
        name = "every-other"
        summary = "client i holds positions i, i + n, i + 2n, ..."
        source = "ours: a test"
        seed = 0

        @dataclass(frozen=True)
        class Params:
            stride: int = field(default=1, metadata={"help": "take every stride-th sample", "example": "2"})

        key_parts = (R.KeyPart("stride", "st", "every {}"),)
        words = "every other, stride {stride}"

        @classmethod
        def draw(cls, d, params):
            return [np.arange(i, len(d.labels), d.clients * params.stride) for i in range(d.clients)], {}

    assert list(P.SCHEMES)[-1] == "every-other" and P.schemes_using("stride") == ["every-other"]
    p = P.make_partition(np.arange(12) % 3, "every-other", clients=3, stride=2)
    assert [c.tolist() for c in p.clients] == [[0, 6], [1, 7], [2, 8]]
    assert P.partition_key(p) == "every-other-st2-c3-s0"
    assert readable_partition("every-other-st2-c3-s0") == "every other, stride 2, 3 clients"
    with pytest.raises(FedfeatError, match="stride does not apply to scheme 'iid'"):
        P.make_partition(np.arange(12) % 3, "iid", clients=3, stride=2)


def test_a_parameter_two_schemes_disagree_on_is_refused_at_import(clean_registry):
    with pytest.raises(TypeError, match="disagrees"):

        @R.register_scheme
        class Bad(R.Scheme):
            name = "bad"
            summary = "x"
            source = "x"
            seed = 0

            @dataclass(frozen=True)
            class Params:
                alpha: int = field(default=1, metadata={"help": "another alpha", "example": "1"})

    assert "bad" not in P.SCHEMES
