"""fedfeat: federated learning on cached frozen-CLIP features.

The Python API (the CLI calls the same functions)::

    import fedfeat
    st = fedfeat.open_store("cache/synth-cifar10.zarr")             # a FeatureStore, read-only
    run = fedfeat.train(store=st, method="fst-cbdg", rounds=10, seed=0, params={"sigma": 0.5}, out="runs")
    run.summary["final_acc"], run.path, run.metrics, run.weights()  # a fedfeat.Run (run["final_acc"] works too)
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
    "Run",
    "load_results",
    "evaluate_run",
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
    "Run": "fedfeat.runs.run",
    "load_results": "fedfeat.report.load",
    "evaluate_run": "fedfeat.runs.evaluate",
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


def train(
    *, params: dict | None = None, overwrite: bool = False, progress: bool = False, callbacks=None, **settings
):
    """Train one run (keyword arguments as ``fedfeat train``'s flags, e.g. ``method="fedavg", rounds=5,
    partition="shard", shards=2``; ``params`` the method's hyperparameters) and return it as a ``fedfeat.Run``
    (``fedfeat.runs.run``): ``.path``, ``.config``, ``.summary``, ``.metrics``, ``.weights()``, ``.results()``;
    ``run["final_acc"]`` reads its summary as the dict ``train`` used to return did.
    ``callbacks``: live logging, callback objects or logger names (``"tensorboard"``, ``"wandb"``; README,
    "Live logging"), called at the run's start, after each round, at its end and on failure.

    Checked like the CLI's flags, each refusal one ``FedfeatError`` line: paths (``store``, ``out``,
    ``pretrained``) may be any ``os.PathLike``, ``store`` also an open ``FeatureStore`` (the run reopens it
    read-only by its path or URL); a setting takes its flag's type (numpy numbers are taken as
    Python numbers; a string is never converted: ``rounds="3"`` is refused); ``params`` is a dict of
    hyperparameter name -> number, string or bool, each of the type of the method's field (``{"lr": [1]}`` and
    ``{"lr": "fast"}`` are refused, a string is parsed as ``--set`` parses it)."""
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.run import Run
    from fedfeat.runs.train import train as _train

    _flag("overwrite", overwrite)
    _flag("progress", progress)
    settings = _settings(settings)
    overrides = _params(params, settings.get("method"))
    cfg = resolve_config(settings, None, [f"{k}={v}" for k, v in overrides.items()])
    path = _train(
        cfg, overwrite=overwrite, progress=progress, log=lambda *a: None, callbacks=_callbacks(callbacks)
    )
    return Run.load(path)


def load_runs(*paths, metrics: bool = False, as_frame: bool | None = None):
    """Finished runs as records (a DataFrame when pandas is installed); see ``fedfeat.report.load.load_runs``.
    ``paths``: run directories or their parents, each a ``str`` or ``os.PathLike``.

    ``metrics=True``: a long table, one row per run and round: the run's columns (``method``, ``partition``,
    ``seed``, ``params.<name>``, ``path``, ... as without ``metrics``) and that round's ``metrics.jsonl`` values
    (``round``, ``test_acc``, ``train_loss``, ...); a key both have (``seconds``, ``bytes_up``, ``val_acc``, ...)
    holds the round's value there (the run's total stays in ``load_runs()`` without ``metrics``)."""
    import os

    from fedfeat.report.load import load_runs as _load_runs
    from fedfeat.store.featurestore import path_arg

    paths = tuple(os.fspath(path_arg(p, f"load_runs path {i + 1}", "runs")) for i, p in enumerate(paths))
    _flag("metrics", metrics)
    if as_frame is not None:
        _flag("as_frame", as_frame, "True, False or None")
    if not metrics:
        return _load_runs(*paths, as_frame=as_frame)
    long = [
        {**{k: v for k, v in rec.items() if k != "metrics"}, **row}
        for rec in _load_runs(*paths, metrics=True, as_frame=False)
        for row in rec["metrics"]
    ]
    if as_frame is False:
        return long
    try:
        import pandas as pd
    except ImportError:
        if as_frame:
            from fedfeat.errors import FedfeatError

            raise FedfeatError("load_runs(as_frame=True) needs pandas; pip install pandas") from None
        return long
    return pd.DataFrame.from_records(long)


# ------------------------------------------------------------------------------------ argument checks
def _callbacks(callbacks) -> list:
    """``train``'s ``callbacks`` (live logging, ``fedfeat.runs.callbacks``): a list of callback objects or logger
    names (``"tensorboard"``, ``"wandb"``, a ``fedfeat.callbacks`` plugin), each checked in one line."""
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
        callbacks = [callbacks]
    from fedfeat.integrations.loggers import make_loggers

    return make_loggers(list(callbacks))


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
        if k == "store" and not isinstance(v, (str, os.PathLike)):
            from fedfeat.store.featurestore import FeatureStore

            if isinstance(
                v, FeatureStore
            ):  # an open store: the run reopens it, read-only, by its path or URL
                v = v.path
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
