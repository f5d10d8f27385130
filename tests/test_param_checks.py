"""Hyperparameters that make no sense are refused in one line naming the key and its valid range (issue 36:
``--set mu=-1`` was accepted for fedprox). The cases are generated from the registry and the declared ranges
(``fedfeat.methods.base.declared_ranges``), so a new method, or a new field with a range, is covered by itself."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, get_method
from fedfeat.methods.base import ENGINE_RANGES, declared_ranges, parse_range


def _numeric_fields(cls) -> dict[str, type]:
    """``{field: int or float}`` of a method's params (``Optional[float]`` counts as float)."""
    hints = typing.get_type_hints(cls.Params)
    out = {}
    for f in dataclasses.fields(cls.Params):
        t = hints[f.name]
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            t = args[0] if len(args) == 1 else None
        if t in (int, float):
            out[f.name] = t
    return out


def _one_line(name: str, sets: dict) -> str:
    with pytest.raises(FedfeatError) as e:
        get_method(name, sets)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_every_numeric_hyperparameter_of_every_method_refuses_an_absurd_value():
    """A million below zero is wrong for every number a method takes (a rate, a count, a weight, a temperature, a
    percentile, a depth): each is refused in one line that names the key and a range (a comparison). The fields
    found here: every numeric field of every registered method (a new one is covered by itself)."""
    offenders, checked = [], 0
    for name, cls in REGISTRY.items():
        for key, typ in _numeric_fields(cls).items():
            value = "-1000000" if typ is int else "-1000000.5"
            checked += 1
            try:
                get_method(name, {key: value})
            except FedfeatError as e:
                msg = str(e)
                if "\n" in msg or not re.search(rf"\b{key}\b", msg) or not re.search(r">|<|\bin [\[(]", msg):
                    offenders.append(f"{name}.{key}: {msg}")
            else:
                offenders.append(f"{name}.{key}={value} accepted")
    assert checked > 150  # every method's numeric fields were tried
    assert not offenders, "\n".join(offenders)


def test_the_issues_cases_and_the_engines_keys():
    """The issue's ``mu=-1`` for fedprox, and the keys the engine itself reads from every method (the local plan's
    batch_size and local_epochs, make_optimizer's lr, lr_decay, momentum, weight_decay) for methods that did not
    check them: zeroshot's plan, every linear head's lr_decay."""
    assert _one_line("fedprox", {"mu": "-1"}) == (
        "fedprox: mu = -1.0 is out of range: mu must be >= 0; e.g. --set mu=0.01"
    )
    assert "batch_size must be >= 1" in _one_line("zeroshot", {"batch_size": "0"})
    assert "local_epochs must be >= 1" in _one_line("zeroshot", {"local_epochs": "-2"})
    assert "lr_decay must be in (0, 1]" in _one_line("fedavg", {"lr_decay": "0"})
    assert "lr_decay must be in (0, 1]" in _one_line("fedntd", {"lr_decay": "1.5"})
    assert "server_momentum must be in [0, 1)" in _one_line("fedavgm", {"server_momentum": "1"})
    assert "server_lr must be > 0" in _one_line("fedavgm", {"server_lr": "0"})
    assert "tau must be > 0" in _one_line("fedntd", {"tau": "0"})
    assert "beta must be >= 0" in _one_line("fedntd", {"beta": "-0.5"})
    assert "teacher_logit_scale must be > 0" in _one_line("clip2fl", {"teacher_logit_scale": "0"})
    # the engine's keys hold wherever a method has the field (prompt and adapter methods too)
    assert set(ENGINE_RANGES) <= set(declared_ranges(REGISTRY["fedavg"].Params))
    assert "momentum must be in [0, 1)" in _one_line("promptfl", {"momentum": "1"})
    # what is valid stays valid: the edges that belong to the range
    p = get_method("fedprox", {"mu": "0", "lr_decay": "1", "momentum": "0", "weight_decay": "0"}).p
    assert (p.mu, p.lr_decay, p.momentum, p.weight_decay) == (0.0, 1.0, 0.0, 0.0)


def _edges(text: str, typ: type) -> list[tuple[object, bool]]:
    """``(value, valid)`` at a range's ends: an open end itself and the next value past a closed end are invalid,
    a closed end valid."""
    lo, lo_in, hi, hi_in = parse_range(text)
    step = 1 if typ is int else 1e-6
    out = []
    if math.isfinite(lo):
        out += [(typ(lo), True), (typ(lo - step), False)] if lo_in else [(typ(lo), False)]
    if math.isfinite(hi):
        out += [(typ(hi), True), (typ(hi + step), False)] if hi_in else [(typ(hi), False)]
    return out


EDGE_CASES = [
    pytest.param(name, key, value, valid, text, id=f"{name}-{key}={value}")
    for name, cls in REGISTRY.items()
    for key, text in declared_ranges(cls.Params).items()
    for value, valid in _edges(text, _numeric_fields(cls)[key])
]


@pytest.mark.parametrize("name, key, value, valid, text", EDGE_CASES)
def test_declared_ranges_hold_at_their_edges(name, key, value, valid, text):
    """Every declared range of every registered method, at its ends: an end outside the range is refused in one
    line with the key, the value and the range; an end inside is accepted (no off-by-one either way)."""
    if valid:
        assert getattr(get_method(name, {key: value}).p, key) == value
    else:
        msg = _one_line(name, {key: value})
        words = text if text[0] in "<>" else f"in {text}"
        assert msg.startswith(
            f"{name}: {key} = {value} is out of range: {key} must be {words}; e.g. --set {key}="
        )


def test_every_declared_default_is_in_its_range():
    for name, cls in REGISTRY.items():
        ranges = declared_ranges(cls.Params)
        assert ranges, name  # at least the engine's batch_size and local_epochs
        defaults = cls.Params()
        for key, text in ranges.items():
            lo, lo_in, hi, hi_in = parse_range(text)
            v = getattr(defaults, key)
            assert (lo < v or (lo_in and v == lo)) and (v < hi or (hi_in and v == hi)), (name, key, v, text)


def test_a_bad_range_declaration_is_refused_at_register_in_one_line():
    """A plugin's ``RANGES`` in a form that is not read (``"positive"``, a list) is refused when the class is
    registered, not when a value happens to be checked."""
    from fedfeat.methods import register
    from fedfeat.methods.linear import FedAvg

    for bad in ("positive", [0, 1]):

        @dataclasses.dataclass(frozen=True)
        class P(FedAvg.Params):
            smoothing: float = 0.1

            RANGES = {"smoothing": bad}

        cls = type("Plug", (FedAvg,), {"name": "test-ranges-plug", "Params": P})
        with pytest.raises(FedfeatError) as e:
            register(cls)
        assert str(e.value).startswith("test-ranges-plug: RANGES['smoothing']: range ")
        assert str(e.value).endswith("; fix the params class's RANGES") and "\n" not in str(e.value)
        assert "test-ranges-plug" not in REGISTRY


# ----------------------------------------------------------------------------------------------- the command line
def _cli_cases() -> list[tuple[str, str, object]]:
    """One case per params class that declares ranges of its own (``RANGES``) and per key of it: the first
    registered federated method with that class, the first invalid value at the range's edges."""
    out = {}
    for name, cls in REGISTRY.items():
        if not cls.federated:
            continue
        for base in cls.Params.__mro__:
            for key, text in (vars(base).get("RANGES") or {}).items():
                bad = next(v for v, ok in _edges(text, _numeric_fields(cls)[key]) if not ok)
                out.setdefault((base, key), (name, key, bad))
    return list(out.values())


@pytest.mark.parametrize(
    "name, key, value", [("fedprox", "mu", -1.0), ("zeroshot", "batch_size", 0)] + _cli_cases()
)
def test_train_refuses_an_out_of_range_set_in_one_line(name, key, value, tmp_path):
    """``fedfeat train --set key=value`` exits 2 with one line naming the key and the range, before it reads a
    store (there is none at the path) or writes anything."""
    out = tmp_path / "runs"
    r = CliRunner().invoke(
        app, ["train", "--method", name, "--store", str(tmp_path / "none.zarr"), "--set", f"{key}={value}",
              "--out", str(out)],
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}: {key} = "), r.output
    assert f"{key} must be " in lines[0] and "out of range" in lines[0]
    assert not out.exists() or not any(out.iterdir())
