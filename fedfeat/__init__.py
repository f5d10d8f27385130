"""fedfeat: federated learning on cached frozen-CLIP features.

The Python API (the CLI calls the same functions)::

    import fedfeat
    st = fedfeat.open_store("cache/synth-cifar10.zarr")             # a FeatureStore, read-only
    run = fedfeat.train(method="fst-cbdg", rounds=10, seed=0, params={"sigma": 0.5}, out="runs")
    run["final_acc"], run["path"]
    df = fedfeat.load_runs("runs")                                  # a DataFrame with pandas, else a list of dicts

The pieces, for a loop of your own (README, "Your own method"; docs/architecture.md)::

    part = fedfeat.make_partition(st.labels("train"), "dirichlet", clients=100, alpha=0.1)
    data = fedfeat.engine.data.load_run_data(st, part)
    glob, rows = fedfeat.run_federated(fedfeat.get_method("fedavg"), data, rounds=10, participation=0.1, seed=0)
"""

from fedfeat._version import __version__

__all__ = [
    "open_store",
    "train",
    "load_runs",
    "RunConfig",
    "FeatureStore",
    "FedfeatError",
    "Method",
    "LinearHead",
    "register",
    "get_method",
    "make_partition",
    "run_federated",
    "__version__",
]

# the rest of the public API, imported on first use (``import fedfeat`` stays light)
_LAZY = {
    "RunConfig": "fedfeat.runs.config",
    "FeatureStore": "fedfeat.store.featurestore",
    "FedfeatError": "fedfeat.errors",
    "Method": "fedfeat.methods",
    "LinearHead": "fedfeat.methods",
    "register": "fedfeat.methods",
    "get_method": "fedfeat.methods",
    "make_partition": "fedfeat.partition",
    "run_federated": "fedfeat.engine.rounds",
}


def open_store(path, mode: str = "r", *, overwrite: bool = False, allow_incomplete: bool = False):
    """A feature store (``fedfeat.store.featurestore.FeatureStore``), read-only by default.

    ``path``: a ``str`` (a path or a store URL) or any ``os.PathLike``. ``mode``: ``"r"`` reads (never writes),
    ``"r+"`` writes into a store (partitions), ``"w"`` rewrites an existing store's chunks (a complete one only
    with ``overwrite=True``, and it stays unfinished until ``mark_complete``). Opening never deletes anything;
    ``FeatureStore.create`` makes a new store. Anything else is a one-line ``FedfeatError``."""
    from fedfeat.store.featurestore import FeatureStore

    return FeatureStore.open(path, mode=mode, overwrite=overwrite, allow_incomplete=allow_incomplete)


def train(*, params: dict | None = None, overwrite: bool = False, progress: bool = False, **settings) -> dict:
    """Train one run (keyword arguments as ``fedfeat train``'s flags, e.g. ``method="fedavg", rounds=5,
    partition="shard", shards=2``; ``params`` the method's hyperparameters) and return its record: the run's
    ``summary.json`` plus ``path``.

    Checked like the CLI's flags, each refusal one ``FedfeatError`` line: paths (``store``, ``out``,
    ``pretrained``) may be any ``os.PathLike``; a setting takes its flag's type (numpy numbers are taken as
    Python numbers; a string is never converted: ``rounds="3"`` is refused); ``params`` is a dict of
    hyperparameter name -> number, string or bool, each of the type of the method's field (``{"lr": [1]}`` and
    ``{"lr": "fast"}`` are refused, a string is parsed as ``--set`` parses it)."""
    import json
    from pathlib import Path

    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.train import train as _train

    _flag("overwrite", overwrite)
    _flag("progress", progress)
    settings = _settings(settings)
    overrides = _params(params, settings.get("method"))
    cfg = resolve_config(settings, None, [f"{k}={v}" for k, v in overrides.items()])
    path = _train(cfg, overwrite=overwrite, progress=progress, log=lambda *a: None)
    return {**json.loads((Path(path) / "summary.json").read_text()), "path": str(path)}


def load_runs(*paths, metrics: bool = False, as_frame: bool | None = None):
    """Finished runs as records (a DataFrame when pandas is installed); see ``fedfeat.report.load.load_runs``.
    ``paths``: run directories or their parents, each a ``str`` or ``os.PathLike``."""
    import os

    from fedfeat.report.load import load_runs as _load_runs
    from fedfeat.store.featurestore import path_arg

    paths = tuple(os.fspath(path_arg(p, f"load_runs path {i + 1}", "runs")) for i, p in enumerate(paths))
    _flag("metrics", metrics)
    if as_frame is not None:
        _flag("as_frame", as_frame, "True, False or None")
    return _load_runs(*paths, metrics=metrics, as_frame=as_frame)


# ------------------------------------------------------------------------------------ argument checks
def _flag(name: str, v, want: str = "True or False") -> None:
    if not isinstance(v, bool):
        from fedfeat.errors import FedfeatError

        raise FedfeatError(f"{name} must be {want}, got {_show(v)}")


def _show(v, n: int = 60) -> str:
    r = repr(v)
    return (r if len(r) <= n else r[: n - 3] + "...") + (
        "" if isinstance(v, str) else f" ({type(v).__name__})"
    )


def _settings(settings: dict) -> dict:
    """``train``'s keyword settings, checked and converted as the CLI's flags are: paths (``os.PathLike``) become
    strings, numpy numbers Python numbers; a value of the wrong type, or an unknown setting, is one line naming
    the setting and what it takes (the valid settings)."""
    import numbers
    import os

    from fedfeat.errors import FedfeatError
    from fedfeat.runs.config import DEFAULTS, TYPES

    unknown = sorted(k for k in settings if k not in DEFAULTS or k == "store_fingerprint")
    if unknown:  # with any value, None included (resolve_config drops None values first)
        valid = sorted(k for k in DEFAULTS if k != "store_fingerprint")
        raise FedfeatError(
            f"unknown run settings {unknown}; valid: {valid} (and params, overwrite, progress)"
        )
    out = {}
    for k, v in settings.items():
        if v is None:
            out[k] = v
            continue
        want = TYPES.get(k, str)
        if want is str and isinstance(v, os.PathLike):
            v = os.fspath(v)
        is_bool = isinstance(v, bool) or type(v).__name__ == "bool_"
        if want is int and isinstance(v, numbers.Integral) and not is_bool:
            v = int(v)
        elif want is float and isinstance(v, numbers.Real) and not is_bool:
            v = float(v)
        elif not isinstance(v, str) or want is not str:
            word = {int: "an integer", float: "a number", str: "a string"}[want]
            eg = {int: "10", float: "0.5", str: repr(str(DEFAULTS.get(k) or "text"))}[want]
            conv = "; a string is not converted, pass the number itself" if isinstance(v, str) else ""
            raise FedfeatError(
                f"fedfeat.train: {k}={_show(v)} is not {word}; {k} takes {word} (the CLI's "
                f"--{k.replace('_', '-')}), e.g. {k}={eg}{conv}"
            )
        out[k] = v
    return out


def _params(params, method) -> dict:
    """``train``'s ``params``: a dict of hyperparameter name -> number, string or bool (numpy numbers taken as
    Python numbers), each of its field's type in ``method`` when that method is registered (as ``get_method``
    checks them); returns them for ``--set``-style parsing (``str(v)`` parses back to ``v``)."""
    import numbers
    from collections.abc import Mapping

    from fedfeat.errors import FedfeatError
    from fedfeat.methods.base import REGISTRY, check_overrides
    from fedfeat.runs.config import DEFAULTS

    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise FedfeatError(
            f"params must be a dict of hyperparameters, got {_show(params)}; e.g. params={{'lr': 0.01}}"
        )
    out = {}
    for k, v in params.items():
        if not isinstance(k, str) or not k or "=" in k:
            raise FedfeatError(
                f"params: key {_show(k)} is not a hyperparameter name; e.g. params={{'lr': 0.01}}"
            )
        if isinstance(v, numbers.Number) and not isinstance(v, (bool, int, float)):
            v = v.item() if hasattr(v, "item") else v  # numpy scalars
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise FedfeatError(
                f"params: {k}={_show(v)} is not a number, a string or a bool; a hyperparameter takes one, "
                f"e.g. params={{'{k}': 0.01}} (the CLI's --set {k}=0.01)"
            )
        out[k] = v
    name = method if method is not None else DEFAULTS["method"]
    if isinstance(name, str) and name in REGISTRY:
        check_overrides(REGISTRY[name], out)  # each value of its field's type, in one line
    return {k: ("none" if v is None else v) for k, v in out.items()}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedfeat' has no attribute {name!r}")
