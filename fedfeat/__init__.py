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


def open_store(path, mode: str = "r"):
    """A feature store (``fedfeat.store.featurestore.FeatureStore``), read-only by default."""
    from fedfeat.store.featurestore import FeatureStore

    return FeatureStore.open(path, mode=mode)


def train(*, params: dict | None = None, overwrite: bool = False, progress: bool = False, **settings) -> dict:
    """Train one run (keyword arguments as ``fedfeat train``'s flags, e.g. ``method="fedavg", rounds=5,
    partition="shard", shards=2``; ``params`` the method's hyperparameters) and return its record: the run's
    ``summary.json`` plus ``path``."""
    import json
    from pathlib import Path

    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.train import train as _train

    cfg = resolve_config(settings, None, [f"{k}={v}" for k, v in (params or {}).items()])
    path = _train(cfg, overwrite=overwrite, progress=progress, log=lambda *a: None)
    return {**json.loads((Path(path) / "summary.json").read_text()), "path": str(path)}


def load_runs(*paths, metrics: bool = False, as_frame: bool | None = None):
    """Finished runs as records (a DataFrame when pandas is installed); see ``fedfeat.report.load.load_runs``."""
    from fedfeat.report.load import load_runs as _load_runs

    return _load_runs(*paths, metrics=metrics, as_frame=as_frame)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedfeat' has no attribute {name!r}")
