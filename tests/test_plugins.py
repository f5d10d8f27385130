"""User-defined methods through the ``fedfeat.methods`` entry point group appear in the registry and the CLI."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from importlib.metadata import EntryPoint

import pytest
from typer.testing import CliRunner

import fedfeat.methods as M
from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError


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
