"""Sweep grids that are too big, too deep, or whose points share a run name (issue 36).

* Points that would be one run directory but are different runs (``name`` given to several seeds) are refused
  before anything runs, naming both points and the fix; points that differ only in what the run ignores
  (``zeroshot`` over partitions) stay one run.
* A grid of more than ``MAX_POINTS`` points (counted as the product of its axes, never expanded), a ``--seed`` range
  as long, or nested deeper than ``MAX_DEPTH`` (a TOML parser's RecursionError included) is one line, at once.
* ``reproduce --list NAME`` with an unknown name is one line naming the known tables.
* A property (hypothesis) over random grid TOML documents -- valid and invalid keys, values, types, nested tables,
  big and deep ones: each is refused with one ``FedfeatError`` line, or expands to exactly the product of its axes
  with every point a grid's setting of a scalar value, resolved by ``configs`` (or refused there in one line).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys

import pytest
import tomllib
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.runs import grid
from fedfeat.runs import sweep as sw
from fedfeat.spec import FIELDS, SWEEP_FIXED, SWEEPABLE

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def _one_line(r) -> str:
    """Exit status 2, exactly one line ``error: ...``, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("gh") / "s.zarr"
    r = _cli("synth", "--out", out, "--classes", "4", "--dim", "16", "--train-per-class", "20",
             "--test-per-class", "5", "--templates", "2", "--no-stats")  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


# ------------------------------------------------------------------------------------------- run names
def test_points_that_share_a_run_name_are_refused_before_anything_runs(store, tmp_path):
    out = tmp_path / "runs"
    base = {"store": str(store), "clients": 2, "rounds": 1, "kernel": "torch", "out": str(out)}
    with pytest.raises(FedfeatError) as e:
        sw.run_sweep(
            [({**base, "name": "x", "seed": 0}, {}), ({**base, "name": "x", "seed": 1}, {})], log=print
        )
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("grid points 1 and 2 are different runs (seed 0 / 1)")
    assert "one run name, x;" in msg and "drop name" in msg
    assert not out.exists() or not any(out.iterdir())  # nothing ran
    # one name for points that are one run (zeroshot draws no partition): made once, both points get it
    z = {**base, "method": "zeroshot", "name": "z"}
    paths = sw.run_sweep([({**z, "partition": "iid"}, {}), ({**z, "partition": "shard"}, {})], log=print)
    assert paths == [out / "z", out / "z"] and sorted(p.name for p in out.iterdir()) == ["z"]
    # in a grid file, name is the sweep's own to set: refused in one line, nothing written
    g = tmp_path / "g.toml"
    g.write_text(f'[fixed]\nname = "x"\nstore = "{store}"\nrounds = 1\n[grid]\nseed = [0, 1]\n')
    line = _one_line(_cli("sweep", "--grid", g, "--out", tmp_path / "o2", "--quiet"))
    assert "name is the sweep's to set" in line and "drop it" in line
    assert not (tmp_path / "o2").exists()


# ----------------------------------------------------------------------------------------------- bounds
def test_a_grid_too_big_is_refused_before_it_is_expanded(tmp_path, store):
    # 3^20 points: 12 run settings and 8 of fedprox's hyperparameters, 3 values each, all valid
    axes = {"seed": [0, 1, 2], "rounds": [1, 2, 3], "clients": [2, 3, 4], "participation": [0.5, 0.75, 1.0],
            "eval_every": [1, 2, 3], "partition_seed": [1, 2, 3], "min_size": [1, 2, 3], "alpha": [0.1, 0.5, 1.0],
            "imbalance_factor": [1.0, 10.0, 100.0], "val_split": [0.1, 0.2, 0.3],
            "shot_thresholds": ["10,2", "20,4", "30,6"], "kernel": ["auto", "torch", "fused"]}  # fmt: skip
    params = {"lr": [0.1, 0.01, 0.001], "momentum": [0.0, 0.5, 0.9], "weight_decay": [0.0, 1e-5, 1e-4],
              "logit_scale": [1.0, 10.0, 100.0], "batch_size": [8, 16, 32], "local_epochs": [1, 2, 3],
              "lr_decay": [1.0, 0.99, 0.9], "mu": [0.01, 0.1, 1.0]}  # fmt: skip
    g = tmp_path / "big.toml"
    g.write_text(
        f'[fixed]\nstore = "{store}"\nmethod = "fedprox"\npartition = "dirichlet"\n[grid]\n'
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in axes.items())
        + "[grid.params]\n"
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in params.items())
    )
    line = _one_line(_cli("sweep", "--grid", g, "--out", tmp_path / "o", "--quiet"))
    assert f"{3**20} grid points (3 x 3 x" in line and "at most" in line and "split it" in line
    assert not (tmp_path / "o").exists()
    # one huge axis (from Python), and a --seed range as long
    with pytest.raises(FedfeatError, match=r"^sweep grid: 200000 grid points \(200000\), more than"):
        sw.expand(grid={"seed": list(range(200_000))})
    line = _one_line(_cli("sweep", "--store", store, "--seed", "0-1000000000000", "--out", tmp_path / "o"))
    assert "--seed '0-1000000000000' is 1000000000001 values" in line
    assert (
        len(sw.expand(grid={"seed": list(range(sw.MAX_POINTS))})) == sw.MAX_POINTS
    )  # the bound itself: made


def _nested(depth: int, inner: str = "0") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("depth", [5000, 500, 9])
@pytest.mark.parametrize("limit", [1000, 20000])  # the TOML parser runs out of stack, or the grid is refused
def test_a_grid_nested_too_deep_is_one_line(tmp_path, depth, limit, request):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    request.addfinalizer(lambda: sys.setrecursionlimit(old))
    g = tmp_path / "deep.toml"
    g.write_text(f"[grid]\nseed = {_nested(depth)}\n")
    line = _one_line(_cli("sweep", "--grid", g, "--out", tmp_path / "o"))
    assert "nested" in line and str(g) in line
    _one_line(_cli("train", "--config", g, "--out", tmp_path / "o"))  # a --config file as deep: one line too
    # tables nested by dotted keys, and inline tables
    g.write_text("[grid]\n" + ".".join(f"k{i}" for i in range(depth)) + " = 1\n")
    assert "nested" in _one_line(_cli("sweep", "--grid", g, "--out", tmp_path / "o"))
    g.write_text("[grid]\nseed = " + "{a = " * depth + "1" + "}" * depth + "\n")
    assert "nested" in _one_line(_cli("sweep", "--grid", g, "--out", tmp_path / "o"))
    # from Python: the same bound, no RecursionError
    deep: list = [0]
    for _ in range(depth):
        deep = [deep]
    with pytest.raises(FedfeatError, match="nested deeper than a grid's"):
        sw.expand(grid={"seed": deep})
    with pytest.raises(FedfeatError, match="nested deeper than a grid's"):
        sw.expand(cells=[{"params": {"lr": deep}}])


def test_reproduce_list_of_an_unknown_table_is_one_line():
    line = _one_line(_cli("reproduce", "--list", "fst-cbdg-table9"))
    assert "unknown table 'fst-cbdg-table9'; known: fst-cbdg-table1, " in line and "fedcopl-table1" in line
    one = _cli("reproduce", "--list", "fst-cbdg-table4", "--format", "json")
    assert one.exit_code == 0 and [t["name"] for t in json.loads(one.output)] == ["fst-cbdg-table4"]


# --------------------------------------------------------------------------------------- property test
def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_string(k)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else "inf" if v == math.inf else "-inf" if v == -math.inf else repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, datetime.date):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _toml_doc(doc: dict) -> str:
    """Tables as ``[name]`` sections (a ``params`` table inside as ``[name.params]``), arrays of tables as
    ``[[name]]``, everything else inline."""
    out = []
    for k, v in doc.items():
        if isinstance(v, dict):
            inner = {a: b for a, b in v.items() if not (a == "params" and isinstance(b, dict))}
            out.append(
                f"[{_toml_key(k)}]\n"
                + "".join(f"{_toml_key(a)} = {_toml_value(b)}\n" for a, b in inner.items())
            )
            if isinstance(v.get("params"), dict):
                p = v["params"]
                out.append(
                    f"[{_toml_key(k)}.params]\n"
                    + "".join(f"{_toml_key(a)} = {_toml_value(b)}\n" for a, b in p.items())
                )
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out += [
                f"[[{_toml_key(k)}]]\n"
                + "".join(f"{_toml_key(a)} = {_toml_value(b)}\n" for a, b in x.items())
                for x in v
            ]
        else:
            out.insert(0, f"{_toml_key(k)} = {_toml_value(v)}\n")
    return "\n".join(out)


GRID_KEYS = [k for k in FIELDS if k in SWEEPABLE or k in SWEEP_FIXED]
# values a grid takes (each setting's own examples, and some more) and values it refuses
GOOD = {"method": ["fst-cbdg", "centralized", "zeroshot"], "partition": ["dirichlet"], "seed": [0, 1, 2**62],
        "rounds": [2], "clients": [2, 3], "participation": [0.25]}  # fmt: skip
BAD = {"method": ["nope"], "partition": ["x"], "seed": [2**64], "rounds": [0, -1], "clients": [0, -2],
       "participation": [0.0, 2.0, math.nan], "alpha": [-1.0, math.inf], "eval_every": [0]}  # fmt: skip
PARAMS = {"lr": [0.1, 0.01], "mu": [0.0, 0.1], "batch_size": [8], "sigma": [0.5, 2.0], "normalize": [True, False],
          "init": ["text", "zeros"], "local_epochs": [1, 2]}  # fmt: skip
BAD_PARAMS = [-1.0, "0.1", math.inf, math.nan, 0, 2.5, "x", 2**70]
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=5)
junk = st.one_of(st.booleans(), st.integers(-(2**65), 2**65), st.floats(), TEXT, st.dates(),
                 st.sampled_from(["0-4", "0,1", "", "iid", "cpu"]))  # fmt: skip
SWEEP_KEYS = [
    k for k in GRID_KEYS if k in SWEEPABLE and k not in ("store", "out")
]  # keys a clean grid varies


def _good(key: str):
    return st.sampled_from([*(FIELDS[key].examples if key in FIELDS else ()), *GOOD.get(key, [])] or ["x"])


def _bad(key: str):
    return st.one_of(st.sampled_from(BAD.get(key, ["x"])), junk)


def _nest(v, depth: int):
    for _ in range(depth):
        v = [v]
    return v


def _table(hostile: bool, axis: bool):
    """A table of settings (an axis each with ``axis``) and maybe a params table. Clean: known keys, their own
    values. Hostile: now and then a refused or random key, a value of the wrong type or range, an empty list, a
    value nested up to 600 deep."""

    def one(key: str, param: bool):
        good = st.sampled_from(PARAMS[key]) if param and key in PARAMS else _good(key) if not param else junk
        if not hostile:
            return good
        return st.one_of(*[good] * 5, _bad(key) if not param else st.sampled_from(BAD_PARAMS) | junk)

    def value(key: str, param: bool = False):
        v = one(key, param)
        if not axis:
            return v
        lists = st.lists(v, min_size=1, max_size=3)
        if not hostile:
            return st.one_of(v, lists, lists)
        return st.one_of(v, lists, lists, lists, st.just([]), st.builds(_nest, v, st.integers(2, 600)))

    def build(keys: list, pkeys: list):
        s = st.fixed_dictionaries({k: value(k) for k in keys})
        p = st.fixed_dictionaries({k: value(k, True) for k in pkeys})
        return st.builds(lambda a, b, with_p: {**a, "params": b} if with_p and b else a, s, p, st.booleans())

    if hostile:
        key = st.one_of(
            *[st.sampled_from(GRID_KEYS)] * 8, st.sampled_from(["name", "store_fingerprint"]), TEXT
        )
        pkey = st.one_of(*[st.sampled_from(sorted(PARAMS))] * 4, TEXT)
    else:
        key = st.sampled_from(SWEEP_KEYS if axis else GRID_KEYS[:1] + SWEEP_KEYS)
        pkey = st.sampled_from(sorted(PARAMS))
    keys = st.tuples(st.lists(key, max_size=3, unique=True), st.lists(pkey, max_size=2, unique=True))
    return keys.flatmap(lambda kp: build(*kp))


def _cells(hostile: bool):
    tables = st.lists(_table(hostile, False), min_size=0 if hostile else 1, max_size=3)
    named = st.dictionaries(st.sampled_from(["methods", "partitions", "x y"]), tables, min_size=0 if hostile else 1,
                            max_size=2)  # fmt: skip
    return st.one_of(tables, named, junk) if hostile else st.one_of(tables, named)


def _doc(fixed, grid, cells, other) -> dict:
    return {
        k: v
        for k, v in (("fixed", fixed), ("grid", grid), ("cells", cells), ("other", other))
        if v is not None
    }


# more than MAX_POINTS (at least 320 x 320): refused, never expanded
big_axes = st.fixed_dictionaries({"seed": st.builds(lambda n: list(range(n)), st.integers(320, 1000)),
                                  "rounds": st.builds(lambda n: list(range(1, n + 1)), st.integers(320, 1000))})  # fmt: skip
clean_docs = st.builds(_doc, st.none() | _table(False, False), st.none() | _table(False, True),
                       st.none() | _cells(False), st.none())  # fmt: skip
hostile_docs = st.builds(
    _doc,
    st.one_of(*[_table(True, False)] * 6, junk, st.none()),
    st.one_of(*[_table(True, True)] * 6, big_axes, junk, st.none()),
    st.one_of(st.none(), st.none(), _cells(True)),
    st.one_of(*[st.none()] * 12, junk),  # now and then a table a grid has not
)
grid_docs = st.one_of(clean_docs, hostile_docs)


def _length(v) -> int:
    return len(v) if isinstance(v, list) else 1


def _product(data: dict) -> int:
    """The grid's point count, from the document itself: the product of its axes' lengths."""
    axes = data.get("grid", {})
    n = math.prod(_length(v) for k, v in axes.items() if k != "params")
    n *= math.prod(_length(v) for v in axes.get("params", {}).values())
    c = data.get("cells")
    if isinstance(c, list):
        n *= len(c)
    elif isinstance(c, dict):
        n *= math.prod(len(v) for v in c.values())
    return n


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=grid_docs)
def test_random_grid_files_expand_to_their_product_or_are_one_line(tmp_path_factory, doc):
    path = tmp_path_factory.getbasetemp() / "prop-grid.toml"
    text = _toml_doc(doc)
    path.write_text(text)
    try:
        data = tomllib.loads(text)
    except RecursionError:  # too deep for the parser itself: the grid reader must say so in one line
        data = None
    stage = "read"
    try:
        kw = sw.read_grid(path)
        raw = grid._expand(**kw)  # before equal points are dropped
        points = sw.expand(**kw)
        stage = "resolved"
        cfgs = sw.configs(points)
    except FedfeatError as e:
        msg = str(e)
        assert msg and "\n" not in msg and "Traceback" not in msg, msg
        event(f"refused when {stage}")
        return
    event("accepted")
    assert data is not None
    n = _product(data)
    assert n <= sw.MAX_POINTS and len(raw) == n  # exactly the product of the axes
    for s, p in raw:
        assert set(s) <= set(GRID_KEYS) - {"name", "store_fingerprint"}, s
        assert not any(isinstance(v, (list, dict)) for v in [*s.values(), *p.values()]), (s, p)
    assert len(points) <= n and len(cfgs) == len(points)
    for (s, _), cfg in zip(points, cfgs):
        assert all(getattr(cfg, k) == v for k, v in s.items()), (s, cfg)
