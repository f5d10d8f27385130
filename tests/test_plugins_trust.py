"""Nothing replaced behind the user's back by a plugin (issue 36): a plugin cannot take a built-in method's name, a
broken entry point is one line naming it and its package (in ``fedfeat methods`` and ``train`` alike), a run of a
plugin's method records the plugin, and a hook that returns the wrong shape stops the run in one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fedfeat
import fedfeat.methods as M
from fedfeat.cli.app import app
from fedfeat.engine.data import load_run_data
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods.linear import FedAvg
from fedfeat.partition.make import make_partition
from fedfeat.store.synth import SynthParams, write_synthetic_store

REPO = Path(fedfeat.__file__).resolve().parents[1]  # the checkout whose fedfeat is under test


@pytest.fixture(autouse=True)
def registry_kept():
    """Every test leaves the registry and the plugin table as it found them (whatever it registered)."""
    from fedfeat.methods import base

    table = getattr(base, "PLUGIN_DISTRIBUTIONS", {})
    saved, dists = dict(M.REGISTRY), dict(table)
    yield
    M.REGISTRY.clear()
    M.REGISTRY.update(saved)
    table.clear()
    table.update(dists)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = SynthParams(classes=6, dim=16, train_per_class=40, test_per_class=10, templates=1)
    st = write_synthetic_store(tmp_path_factory.mktemp("tr") / "s.zarr", p, stats=False, log=lambda *_: None)
    return st, make_partition(st.labels("train"), "dirichlet", clients=8, alpha=0.3, seed=2)


def _install(site: Path, dist: str, version: str, modules: dict[str, str], eps: dict[str, str]) -> Path:
    """A distribution as pip leaves it in ``site``: its modules and a ``.dist-info`` (METADATA, top_level.txt, the
    ``fedfeat.methods`` entry points)."""
    site.mkdir(exist_ok=True)
    for mod, src in modules.items():
        (site / f"{mod}.py").write_text(src)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text("".join(f"{m}\n" for m in modules))
    if eps:
        (info / "entry_points.txt").write_text(
            f"[{M.ENTRY_POINT_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        )
    return site


def _use(site: Path, monkeypatch, *modules: str) -> None:
    monkeypatch.syspath_prepend(str(site))
    for m in modules:
        monkeypatch.delitem(sys.modules, m, raising=False)


IMPOSTER = '''
from fedfeat.methods.linear import FedAvg


class Imposter(FedAvg):
    """Twice FedAvg's loss, under FedAvg's name."""

    name = "fedavg"

    def sample_loss(self, ctx, z, y, local):
        return 2 * super().sample_loss(ctx, z, y, local)
'''


# ------------------------------------------------------------------------------------------- a built-in's name
def test_a_plugin_cannot_take_a_builtin_name_but_may_replace_its_own():
    class Imposter(FedAvg):
        name = "fedavg"

    class Inherits(FedAvg):  # no name of its own: FedAvg's
        pass

    for cls in (Imposter, Inherits):
        with pytest.raises(FedfeatError) as e:
            M.register(cls)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(
            f"method plugin {__name__}.{cls.__qualname__} registers the name 'fedavg', which is "
        )
        assert "fedfeat's built-in fedfeat.methods.linear.FedAvg" in msg
        pkg = __name__.split(".")[0].replace("_", "-")  # the plugin's package, in the suggested name
        assert msg.endswith(
            f"a plugin cannot replace a built-in method: give it a name of its own, e.g. name = 'fedavg-{pkg}'"
        )
        assert M.REGISTRY["fedavg"] is FedAvg and type(M.get_method("fedavg")) is FedAvg
    # a plugin's own name, registered again (a notebook cell run twice): replaced, with a warning naming both
    first = type("Cell", (FedAvg,), {"name": "trust-own"})
    second = type("Cell", (FedAvg,), {"name": "trust-own"})
    M.register(first)
    with pytest.warns(UserWarning, match=r"method trust-own: .*Cell replaced by .*Cell"):
        M.register(second)
    assert M.REGISTRY["trust-own"] is second


# ------------------------------------------------------------------------------------------- entry points
BAD_PLUGINS = {
    # kind: (distribution, modules, entry points, what the line says after "method plugin EP (VALUE, package D)")
    "a class named fedavg": (
        "trust-imposter", {"trust_imposter": IMPOSTER}, {"fedavg": "trust_imposter:Imposter"},
        ": method plugin trust_imposter.Imposter registers the name 'fedavg', which is fedfeat's built-in "
        "fedfeat.methods.linear.FedAvg; a plugin cannot replace a built-in method: give it a name of its own, e.g. "
        "name = 'fedavg-trust-imposter'",
    ),
    "a module that registers fedavg": (
        "trust-regs", {"trust_regs": IMPOSTER.replace("import FedAvg", "import FedAvg\nfrom fedfeat.methods import "
                                                      "register").replace("\nclass", "\n@register\nclass")},
        {"mine": "trust_regs"},
        ": method plugin trust_regs.Imposter registers the name 'fedavg', which is fedfeat's built-in "
        "fedfeat.methods.linear.FedAvg; a plugin cannot replace a built-in method: give it a name of its own, e.g. "
        "name = 'fedavg-trust-regs'",
    ),
    "an object that is no method": (
        "trust-obj", {"trust_obj": "NUMBER = 42\n"}, {"num": "trust_obj:NUMBER"},
        " names int '42', neither a module nor a Method subclass; point it at a module that registers its methods "
        "with @register, or at a Method subclass ('mypkg:MyMethod')",
    ),
    "an import error": (
        "trust-broken", {"trust_broken": "import no_such_module_for_fedfeat_xyz\n"}, {"mine": "trust_broken"},
        " failed to import: ModuleNotFoundError: No module named 'no_such_module_for_fedfeat_xyz'; fix or uninstall "
        "the package that declares it",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(BAD_PLUGINS))
def test_a_bad_entry_point_is_one_line_naming_it_and_its_package(kind, tmp_path, monkeypatch):
    dist, modules, eps, says = BAD_PLUGINS[kind]
    _use(_install(tmp_path / "site", dist, "1.0", modules, eps), monkeypatch, *modules)
    with pytest.raises(FedfeatError) as e:
        M.load_plugins()
    ((ep, value),) = eps.items()
    assert str(e.value) == f"method plugin {ep} ({value}, package {dist}){says}"
    assert M.REGISTRY["fedavg"] is FedAvg


def _fresh(args: list[str], site: Path) -> subprocess.CompletedProcess:
    """``python -m fedfeat ARGS`` in a fresh interpreter that sees the distributions in ``site``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "fedfeat", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_methods_and_train_both_surface_the_plugin_error(small, tmp_path):
    """Installed for real (found by importlib.metadata in a fresh process): a plugin class named ``fedavg`` through
    an entry point is neither dropped silently nor run as FedAvg. ``fedfeat methods`` and ``fedfeat train --method
    fedavg`` exit 2 with the same one line, and train writes nothing."""
    st, _ = small
    dist, modules, eps, says = BAD_PLUGINS["a class named fedavg"]
    site = _install(tmp_path / "site", dist, "1.0", modules, eps)
    want = f"error: method plugin fedavg (trust_imposter:Imposter, package trust-imposter){says}"
    out = tmp_path / "runs"
    for args in (["methods"], ["train", "--method", "fedavg", "--store", str(st.path), "--clients", "8",
                                "--rounds", "1", "--out", str(out), "--quiet"]):  # fmt: skip
        r = _fresh(args, site)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.strip() == want and r.stdout.strip() == "", (args, r.stderr)
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------- provenance
PLUGIN_SRC = '''
from fedfeat.methods import register
from fedfeat.methods.linear import FedAvg


@register
class TrustLS(FedAvg):
    """FedAvg, under a plugin's name."""

    name = "trust-ls"
'''


def test_a_plugin_run_records_the_plugin_and_a_builtin_run_does_not(small, tmp_path, monkeypatch):
    """summary.json's provenance names the plugin: class, module, its source file and that file's sha256, the
    distribution that installed it and its version. fedfeat's git commit alone says nothing of the plugin's code.
    A built-in's provenance has no such entry (its records are unchanged)."""
    st, _ = small
    site = _install(
        tmp_path / "site", "trust-ls", "0.3.1", {"trust_ls": PLUGIN_SRC}, {"trust-ls": "trust_ls"}
    )
    _use(site, monkeypatch, "trust_ls")
    assert "trust-ls" in M.load_plugins()
    runs = {}
    for method in ("trust-ls", "fedavg"):
        r = CliRunner().invoke(app, ["train", "--method", method, "--store", str(st.path), "--clients", "8",
                                     "--rounds", "1", "--out", str(tmp_path / method), "--quiet"])  # fmt: skip
        assert r.exit_code == 0, r.output
        (run,) = (tmp_path / method).iterdir()
        runs[method] = json.loads((run / "summary.json").read_text())
    src = site / "trust_ls.py"
    assert runs["trust-ls"]["method"] == "trust-ls"
    assert runs["trust-ls"]["provenance"]["plugin"] == {
        "class": "TrustLS",
        "module": "trust_ls",
        "file": str(src),
        "source_sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
        "distribution": "trust-ls",
        "version": "0.3.1",
    }
    assert "plugin" not in runs["fedavg"]["provenance"]


def test_plugin_info_without_an_entry_point(tmp_path, monkeypatch):
    """A class registered by hand: from an installed distribution (found by its top-level package), and from a
    script or notebook (no distribution: its module and file)."""
    from fedfeat.methods.base import plugin_info

    site = _install(
        tmp_path / "site",
        "trust-hand",
        "2.5",
        {"trust_hand": PLUGIN_SRC.replace("trust-ls", "trust-hand")},
        {},
    )
    _use(site, monkeypatch, "trust_hand")
    import trust_hand  # noqa: F401  (registers trust-hand)

    info = plugin_info(M.REGISTRY["trust-hand"])
    assert (info["module"], info["distribution"], info["version"]) == ("trust_hand", "trust-hand", "2.5")

    class Here(FedAvg):
        name = "trust-here"

    here = plugin_info(Here)
    assert (here["module"], here["class"], here["distribution"], here["version"]) == (
        __name__, "test_plugin_info_without_an_entry_point.<locals>.Here", None, None,
    )  # fmt: skip
    assert (
        here["file"] == str(Path(__file__).resolve())
        or Path(here["file"]).resolve() == Path(__file__).resolve()
    )
    assert plugin_info(FedAvg) is None and plugin_info(M.get_method("fedprox")) is None


# ------------------------------------------------------------------------------------------- hook shapes
@dataclass(frozen=True)
class _P(FedAvg.Params):
    batch_size: int = 8


def _hooked(**hooks):
    return type("Bad", (FedAvg,), {"name": "trust-bad", "Params": _P, **hooks})


def _mean_loss(self, ctx, params, batch, local):
    return FedAvg.step_loss(self, ctx, params, batch, local).mean()  # a scalar: the clients' mean


def _per_sample_loss(self, ctx, params, batch, local):
    z = self.logits(params, batch.x)  # [n, B, K]
    return self.sample_loss(ctx, z, batch.y, local)  # [n, B]: not reduced over the batch


def _wide_predict(self, ctx, glob, x):
    z = FedAvg.predict(self, ctx, glob, x)
    return torch.cat([z, z[:, :1]], 1)  # [N, K + 1]


def _drop_b(self, ctx, plan, old, new):
    return {"W": new["W"]}


def _narrow_w(self, ctx, plan, old, new):
    return {"W": new["W"][:, :-1], "b": new["b"]}


def _extra_key(self, ctx, plan, old, new):
    return {**new, "v": new["b"].clone()}


# K = 6 classes, D = 16, 60 test images, 8 clients at participation 0.5: 4 clients in the round's first step
HOOK_CASES = {
    "step_loss mean": (dict(step_loss=_mean_loss),
                       "step_loss returned a tensor [], expected a tensor [4] (one loss per active client: reduce "
                       "over each client's batch, not over clients)"),
    "step_loss per sample": (dict(step_loss=_per_sample_loss),
                             "step_loss returned a tensor [4, 8], expected a tensor [4] (one loss per active "
                             "client: reduce over each client's batch, not over clients)"),
    "init_global list": (dict(init_global=lambda self, ctx: [ctx.text.clone()]),
                         "init_global returned list [tensor([[", ),
    "init_global array": (dict(init_global=lambda self, ctx: {"W": ctx.text.numpy()}),
                          "init_global returned {'W': ndarray array(["),
    "predict wide": (dict(predict=_wide_predict),
                     "predict returned a tensor [60, 7], expected a tensor [60, 6] (one row per sample of x, one "
                     "column per class)"),
    "predict transposed": (dict(predict=lambda self, ctx, glob, x: FedAvg.predict(self, ctx, glob, x).T),
                           "predict returned a tensor [6, 60], expected a tensor [60, 6]"),
    "server_update drops b": (dict(server_update=_drop_b),
                              "server_update returned the parameters ['W'], expected the same names as the global "
                              "parameters it was given, ['W', 'b']"),
    "server_update narrows W": (dict(server_update=_narrow_w),
                                "server_update returned W as a tensor [6, 15], expected the shape of the global W, a "
                                "tensor [6, 16]"),
    "server_update adds a key": (dict(server_update=_extra_key),
                                 "server_update returned the parameters ['W', 'b', 'v'], expected the same names"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOOK_CASES))
@pytest.mark.parametrize("engine", ["batched", "loop"])
def test_a_hook_of_the_wrong_shape_stops_the_run_in_one_line(small, case, engine):
    hooks, says = HOOK_CASES[case]
    if engine == "loop" and "step_loss" in case:  # one client at a time: [1]
        says = says.replace("[4]", "[1]").replace("[4, 8]", "[1, 8]")
    st, part = small
    data = load_run_data(st, part)
    m = _hooked(**hooks)(_P())
    with pytest.raises(FedfeatError) as e:
        run_federated(m, data, rounds=2, participation=0.5, seed=0, engine=engine, kernel="torch")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"method trust-bad: {says}"), msg


def test_a_plugins_wrong_shape_is_one_line_from_train(small, tmp_path):
    st, _ = small
    M.register(_hooked(step_loss=_mean_loss))
    r = CliRunner().invoke(app, ["train", "--method", "trust-bad", "--store", str(st.path), "--clients", "8",
                                 "--participation", "0.5", "--rounds", "1", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert r.exit_code == 2
    assert r.output.strip() == (
        "error: method trust-bad: step_loss returned a tensor [], expected a tensor [4] (one loss per active client: "
        "reduce over each client's batch, not over clients)"
    )
