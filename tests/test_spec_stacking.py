"""Stacked = one by one, over every setting a sweep can vary (generated from the run specification).

``fedfeat.spec`` declares each setting with ``examples``: values a sweep may vary it to, with the ``context`` it
needs (a scheme parameter: its scheme). This test makes one grid: a base run, and for every sweepable setting and
each of its examples one run that differs from the base in that setting alone (plus its context); the base also
at a second seed, so that it stacks. The grid is made once stacked (the default) and once with ``stack=False``; every run directory's metrics and
weights must be the same in both -- bit for bit with the fused CPU kernels (fedavg), within 1e-5 with the torch
program (fed-focal). A run stacked with a run of other data (the bug of issue 34: ``min_size`` and ``val_split``
were left out of the stack key) fails it. A new setting is covered by declaring its examples; a sweepable setting
without any fails ``test_every_sweepable_setting_has_examples``.

Two settings need a fixture rather than a value: ``store`` (a second store) and ``preset`` (a store with the
preset's class count); the ``domain`` scheme's settings run on a store with two domains.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers_clip import run_cli
from safetensors.torch import load_file

from fedfeat.runs.sweep import run_sweep
from fedfeat.spec import DEFAULTS, FIELDS, SWEEPABLE

BASE = {"clients": 10, "participation": 0.3, "rounds": 2, "partition": "dirichlet", "alpha": 0.3}
FIXTURE = ("store", "preset")  # the values are stores this test builds


def _store(root, name, classes=10, seed=0):
    out = root / name
    r = run_cli(["synth", "--out", out, "--classes", classes, "--dim", "16", "--train-per-class", "30",
                 "--test-per-class", "10", "--templates", "1", "--seed", seed, "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return str(out)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from fedfeat.partition.openvocab import PRESETS

    root = tmp_path_factory.mktemp("specstack")
    preset = FIELDS["preset"].examples[0]
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    domain = root / "d.zarr"  # the domain scheme's store: two domains, named (held_out's example is "sketch")
    write_synthetic_store(domain, SynthParams(classes=10, dim=16, train_per_class=30, test_per_class=10, templates=1,
                                              domains=2, domain_names="photo,sketch"), stats=False, log=lambda *a: 0)  # fmt: skip
    return {
        "base": _store(root, "a.zarr"),
        "store": _store(root, "b.zarr", seed=1),
        "preset": _store(root, "p.zarr", classes=PRESETS[preset]["classes"]),
        "domain": str(domain),
    }


def variants(method: str, stores: dict) -> list[tuple[str, dict]]:
    """(label, settings) for the base and every (sweepable setting, example) pair, at seeds 0 and 1."""
    base = {**BASE, "method": method, "store": stores["base"]}
    out = [("base", dict(base))]
    for k in SWEEPABLE:
        f = FIELDS[k]
        if k == "store":
            out.append(("store", {**base, "store": stores["store"]}))
            continue
        for v in f.examples:
            s = {**base, **f.context, k: v}
            if k == "preset":  # the preset's own settings (disjoint-classes, 10 shots, 10 clients, ...)
                s = {"method": method, "store": stores["preset"], "preset": v, "class_order": "store"}
            if f.context.get("partition") not in (None, base["partition"]) or k == "partition":
                s.pop("alpha", None)  # alpha is dirichlet's
            if f.context.get("partition") == "disjoint-classes" or v == "disjoint-classes":
                s.update(shots=2, clients=4)
            if f.context.get("partition") == "domain" or (k == "partition" and v == "domain"):
                # clients = the training domains x per_domain (two domains, one of them held out or not)
                s.update(store=stores["domain"], partition="domain")
                if s.get("held_out_eval"):  # which rows of a held-out domain are tested: one is held out
                    s.setdefault("held_out", "sketch")
                s["clients"] = (1 if s.get("held_out") else 2) * int(s.get("per_domain") or 1)
                if int(s.get("per_domain") or 1) > 1:  # 5 clients of a tiny domain: some get no test row
                    s.setdefault("min_require_size", 0)
            if f.context.get("partition") == "class-blocks" or (k == "partition" and v == "class-blocks"):
                s.pop("alpha", None)  # 10 classes in blocks of 20 (or 10): one client
                s["clients"] = max(1, round(10 / int(s.get("block_classes") or 20)))
            if s == base:
                continue
            out.append((f"{k}={v}", s))
    # the base at two seeds (they stack); each variant at one: a variant stacked with the base (a setting missing
    # from the stack key) is trained on the base's data and differs from the same run made alone
    return [("base seed=1", {**base, "seed": 1})] + [(lab, {"seed": 0, **s}) for lab, s in out]


def test_every_sweepable_setting_has_examples():
    missing = [k for k in SWEEPABLE if not FIELDS[k].examples and k not in FIXTURE]
    assert not missing, f"declare examples for {missing} in fedfeat.spec (the stacking test varies them)"
    for k in SWEEPABLE:
        for v in FIELDS[k].examples:
            assert v != DEFAULTS[k] or k in ("clients",), (k, v)


def _read(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in [k for k in r if "seconds" in k or k.startswith("sec")]:
            del r[k]
    w = load_file(run / "weights.safetensors") if (run / "weights.safetensors").exists() else {}
    return rows, w


def _close(a, b, tol):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and tol:
        return math.isclose(a, b, rel_tol=0, abs_tol=tol * max(1.0, abs(a)))
    return a == b


@pytest.mark.parametrize("method", ["fedavg", "fed-focal"])
def test_stacked_grid_equals_runs_made_alone(tmp_path, stores, method, monkeypatch):
    """fedavg runs the fused CPU kernel (bit for bit), fed-focal the torch program (1e-5); a run whose kernel is
    torch (``kernel=torch``, the loop engine) is compared at 1e-5 whatever its method. Each run's curve.png is not
    drawn (four fifths of a tiny run's time; the figure is not what is compared)."""
    monkeypatch.setattr("fedfeat.report.plots.plot_curves", lambda *a, **k: None)
    pts = variants(method, stores)
    made = {}
    for mode, stack in (("stacked", True), ("alone", False)):
        points = [({**s, "out": str(tmp_path / mode / s.get("out", "runs"))}, {}) for _, s in pts]
        failures: list = []
        made[mode] = run_sweep(points, stack=stack, progress=False, log=lambda *a: None, failures=failures)
        made[mode + "-failures"] = failures
    # a run that fails, fails the same way made alone (a setting value the tiny store cannot take)
    assert [(f.index, f.error) for f in made["stacked-failures"]] == [
        (f.index, f.error) for f in made["alone-failures"]
    ]
    assert len(made["stacked-failures"]) <= len(pts) // 4, made["stacked-failures"]
    stacked_any = 0
    for (label, _), a, b in zip(pts, made["stacked"], made["alone"]):
        if a is None:
            continue
        assert a.name == b.name, label
        summary = json.loads((a / "summary.json").read_text())
        tol = 0.0 if summary["kernel"] == "fused" else 1e-5
        (ra, wa), (rb, wb) = _read(a), _read(b)
        assert _close(ra, rb, tol), f"{label}: metrics differ stacked vs alone"
        assert wa.keys() == wb.keys(), label
        for k in wa:
            if tol == 0:
                assert torch.equal(wa[k], wb[k]), f"{label}: weights {k} differ"
            else:
                assert torch.allclose(wa[k], wb[k], atol=tol, rtol=0), f"{label}: weights {k} differ"
        stacked_any += summary.get("stacked_runs", 1) > 1
    per_run = sum(FIELDS[k].per_run and k != "out" for k in SWEEPABLE)
    assert stacked_any >= 2 + per_run  # the grid did stack: the base's seeds with the per-run variants
