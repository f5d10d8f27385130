"""User-defined methods through the ``fedfeat.methods`` entry point group appear in the registry and the CLI."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from typer.testing import CliRunner

import fedfeat.methods as M
from fedfeat.cli.app import app
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import resolve_kernel, run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store


def test_an_entry_point_method_is_registered_and_listed(monkeypatch):
    mod = types.ModuleType("fedfeat_test_plugin")

    @dataclass(frozen=True)
    class P:
        batch_size: int = 10
        local_epochs: int = 1
        lr: float = 0.1

    class Mean(M.Method):
        """Plugin test method: a head of class means."""

        name = "plugin-mean"
        Params = P

        def predict(self, ctx, glob, x):
            return x @ ctx.text.T

    mod.Mean = Mean
    monkeypatch.setitem(sys.modules, "fedfeat_test_plugin", mod)
    ep = EntryPoint(name="plugin-mean", value="fedfeat_test_plugin:Mean", group=M.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        "importlib.metadata.entry_points", lambda group=None: [ep] if group == M.ENTRY_POINT_GROUP else []
    )
    monkeypatch.delitem(M.REGISTRY, "plugin-mean", raising=False)
    assert M.load_plugins() == ["plugin-mean"]
    try:
        assert M.get_method("plugin-mean", {"lr": "0.5"}).p.lr == 0.5
        r = CliRunner().invoke(app, ["methods"])
        assert r.exit_code == 0 and "plugin-mean" in r.output
    finally:
        M.REGISTRY.pop("plugin-mean", None)


def test_a_broken_plugin_is_a_one_line_error(monkeypatch):
    ep = EntryPoint(name="broken", value="no_such_module_xyz:Thing", group=M.ENTRY_POINT_GROUP)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: [ep])
    with pytest.raises(
        FedfeatError, match=r"method plugin broken \(no_such_module_xyz:Thing\) failed to import"
    ):
        M.load_plugins()


# ---------------------------------------------------------------------------------------- an installed plugin
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fedfeat-label-smoothing"


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """The README's example plugin (examples/fedfeat-label-smoothing) as pip installs it: its module and a
    ``.dist-info`` with its entry point in a site directory on ``sys.path``; found by ``importlib.metadata``."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(EXAMPLE / "fedfeat_label_smoothing.py", site)
    info = site / "fedfeat_label_smoothing-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedfeat-label-smoothing\nVersion: 0.1.0\n")
    ep = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["entry-points"][
        M.ENTRY_POINT_GROUP
    ]
    (info / "entry_points.txt").write_text(
        f"[{M.ENTRY_POINT_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in ep.items())
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "fedfeat_label_smoothing", raising=False)
    try:
        assert "fedavg-ls" in M.load_plugins()
        yield M.REGISTRY["fedavg-ls"]
    finally:
        M.REGISTRY.pop("fedavg-ls", None)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = SynthParams(classes=6, dim=16, train_per_class=40, test_per_class=10, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("pl") / "s.zarr", p, stats=False, log=lambda *_: None)
    return st, make_partition(st.labels("train"), "dirichlet", clients=8, alpha=0.3, seed=2)


def test_label_smoothing_loss_by_hand(installed_plugin):
    """K = 2, eps = 0.2, logits (0, log 3): softmax (1/4, 3/4). Label 1: (1 - eps) (-log 3/4) + eps/2 (-log 1/4 -
    log 3/4) = 0.8 * 0.28768 + 0.1 * (1.38629 + 0.28768) = 0.397544; label 0: 0.8 * 1.38629 + 0.167398 = 1.276434."""
    m = get_method("fedavg-ls", {"smoothing": "0.2"})
    z = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # [n=1, B=2, K=2]
    got = m.sample_loss(None, z, torch.tensor([[1, 0]]), {})
    torch.testing.assert_close(got, torch.tensor([[0.397544, 1.276434]]), atol=1e-6, rtol=0)


def test_plugin_runs_batched_and_equals_its_per_client_loop(installed_plugin, small, monkeypatch):
    """The plugin changes only the per-sample loss: it gets no fused kernel, runs on the batched torch program with
    all active clients in one call (seen from inside its hook), and equals the same method run client by client."""
    st, part = small
    m = get_method("fedavg-ls", {"batch_size": "8", "local_epochs": "2", "smoothing": "0.3"})
    assert not m.has_fused() and resolve_kernel("auto", m, "batched", torch.device("cpu")) == "torch"
    # --kernel fused says why not: the subclass redefines the per-sample loss of the class whose kernel it would get
    with pytest.raises(
        FedfeatError, match=r"FedAvgLabelSmoothing redefines sample_loss, so LinearHead's fused"
    ):
        resolve_kernel("fused", m, "batched", torch.device("cpu"))
    seen = []
    real = installed_plugin.sample_loss
    monkeypatch.setattr(
        installed_plugin, "sample_loss", lambda self, *a: seen.append(a[1].shape[0]) or real(self, *a)
    )
    data = load_run_data(st, part)
    out = {}
    for engine in ("batched", "loop"):
        seen.clear()
        out[engine] = run_federated(m, data, rounds=3, participation=0.5, seed=4, engine=engine)
        out[engine + "-clients"] = max(seen)
    assert (
        out["batched-clients"] == 4 and out["loop-clients"] == 1
    )  # 50 % of 8 clients in one call vs one by one
    (gb, mb), (gl, ml) = out["batched"], out["loop"]
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        [r["train_loss"] for r in mb[1:]], [r["train_loss"] for r in ml[1:]], rtol=1e-5
    )
    # and it is not FedAvg: smoothing changes the weights
    ga, _ = run_federated(get_method("fedavg", {"batch_size": "8", "local_epochs": "2"}), data, rounds=3,
                          participation=0.5, seed=4, kernel="torch")  # fmt: skip
    assert (ga["W"] - gb["W"]).abs().max() > 1e-4


def test_plugin_trains_from_the_cli(installed_plugin, small, tmp_path):
    st, _ = small
    r = CliRunner().invoke(app, ["train", "--method", "fedavg-ls", "--store", str(st.path), "--clients", "8",
                                 "--rounds", "2", "--set", "smoothing=0.2", "--out", str(tmp_path / "runs"), "--quiet"])  # fmt: skip
    assert r.exit_code == 0, r.output
    (run,) = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    s = json.loads((run / "summary.json").read_text())
    assert s["method"] == "fedavg-ls" and s["kernel"] == "torch" and s["params"]["smoothing"] == 0.2
    bad = CliRunner().invoke(app, ["train", "--method", "fedavg-ls", "--store", str(st.path), "--set",
                                   "smoothing=1.5", "--out", str(tmp_path / "runs")])  # fmt: skip
    assert bad.exit_code == 2 and "smoothing must be in [0, 1)" in bad.output


def test_registering_a_name_again_replaces_it_with_a_warning():
    @dataclass(frozen=True)
    class P:
        batch_size: int = 1
        local_epochs: int = 1

    def make(doc):
        return type("Notebook", (M.Method,), {"name": "nb-method", "Params": P, "__doc__": doc})

    first, second = make("first"), make("second")
    try:
        M.register(first)
        with pytest.warns(UserWarning, match=r"method nb-method: .*Notebook replaced by .*Notebook"):
            M.register(second)
        assert M.REGISTRY["nb-method"] is second
    finally:
        M.REGISTRY.pop("nb-method", None)


def test_optional_fields_parse_from_set_strings():
    """``float | None`` (PEP 604) fields take ``--set`` strings as ``Optional[float]`` ones do: a number or none."""
    from fedfeat.methods.base import make_params

    @dataclass(frozen=True)
    class P:
        q: float | None = None
        k: int | None = 3

    class Opt(M.Method):
        name = "test-optional"
        Params = P

    assert make_params(Opt, {"q": "50", "k": "none"}) == P(q=50.0, k=None)
    with pytest.raises(FedfeatError, match="expected float"):
        make_params(Opt, {"q": "fifty"})
