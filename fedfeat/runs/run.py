"""A finished run, as the Python API hands it back: ``fedfeat.train`` returns one, ``Run.load(path)`` opens one.

``run.path`` (the run directory), ``run.config`` (its ``config.toml`` as a ``RunConfig``; the raw TOML tables when
the config cannot be resolved here, e.g. a plugin method that is not installed), ``run.summary`` (``summary.json``),
``run.metrics`` (one row per round: a pandas DataFrame with pandas installed, else a list of dicts),
``run.weights()`` (``weights.safetensors`` as ``{name: tensor}``), ``run.results()`` (the per-round per-class and
per-client arrays of ``results.npz``: ``fedfeat.report.load.load_results``). ``run["final_acc"]`` (any summary key,
and ``run["path"]`` as a string) keeps code written for the summary dict ``train`` used to return working: a
``Run`` is a read-only mapping of its summary plus ``path``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from fedfeat.errors import FedfeatError

WEIGHTS = "weights.safetensors"


class Run(Mapping):
    """A finished run directory (``fedfeat.runs.train``); read-only. Make one with ``Run.load(path)``."""

    def __init__(self, path: str | os.PathLike, summary: dict, rows: list[dict]):
        self.path = Path(os.fspath(path))
        self.summary = summary
        self._rows = rows
        self._config = None

    @classmethod
    def load(cls, path) -> Run:
        """The finished run in directory ``path`` (a ``str`` or ``os.PathLike``); a directory that is not a finished
        run, or a damaged ``summary.json`` / ``metrics.jsonl``, is one ``FedfeatError`` line."""
        from fedfeat.report.load import load_run
        from fedfeat.store.featurestore import path_arg

        p = Path(os.fspath(path_arg(path, "Run.load path", "runs/<name>")))
        summary, rows = load_run(p)
        return cls(p, summary, rows)

    # ------------------------------------------------------------------ the run's files
    @property
    def config(self):
        """``config.toml`` resolved as ``fedfeat train --config`` resolves it (a ``RunConfig``); its raw tables
        (a dict) when that fails here (a method not registered in this process, a store moved away)."""
        if self._config is None:
            from fedfeat.runs.config import read_toml, resolve_config

            cfile = self.path / "config.toml"
            try:
                self._config = resolve_config({}, cfile, None)
            except FedfeatError:
                self._config = read_toml(cfile, "run config", "runs/<name>/config.toml")
        return self._config

    @property
    def metrics(self):
        """One row per round (round 0: before training), as ``metrics.jsonl`` holds them: a pandas DataFrame when
        pandas is installed, else a list of dicts."""
        try:
            import pandas as pd
        except ImportError:
            return [dict(r) for r in self._rows]
        return pd.DataFrame.from_records(self._rows)

    def weights(self) -> dict:
        """The final global parameters, ``{name: torch.Tensor}`` (safetensors: loading runs no code). A run that
        keeps none (``zeroshot``: nothing is trained) is one ``FedfeatError`` line saying why."""
        from safetensors.torch import load_file

        p = self.path / WEIGHTS
        if not os.path.lexists(p):
            why = self.summary.get("weights")
            raise FedfeatError(f"run {self.path} has no {WEIGHTS}" + (f": {why}" if why else "; re-run it"))
        if not p.is_file():  # a FIFO would block, a directory is no file
            raise FedfeatError(f"{p} is not a regular file; re-run the run")
        try:
            return load_file(str(p))
        except Exception as e:  # safetensors' own errors: a truncated or damaged file
            raise FedfeatError(f"cannot read {p} ({e}); re-run the run") from None

    def results(self) -> dict:
        """The per-round per-class and per-client arrays (``results.npz``: ``rounds``, ``class_acc``,
        ``client_acc``, ``confusion``), ``{}`` for a run made before they were kept."""
        try:
            from fedfeat.report.load import load_results
        except ImportError:  # a fedfeat without per-class results
            return {}
        return load_results(self.path)

    # ------------------------------------------------------------------ the summary as a mapping
    def _record(self) -> dict:
        return {**self.summary, "path": str(self.path)}

    def __getitem__(self, key: str):
        if key == "path":
            return str(self.path)
        return self.summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._record())

    def __len__(self) -> int:
        return len(self._record())

    def __repr__(self) -> str:
        acc = self.summary.get("final_acc")
        acc = f", final_acc={acc:.2f}" if isinstance(acc, (int, float)) else ""
        return f"Run({str(self.path)!r}, method={self.summary.get('method')!r}{acc})"
