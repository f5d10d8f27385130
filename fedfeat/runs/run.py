"""A finished run, as the Python API hands it back: ``fedfeat.train`` returns one, ``Run.load(path)`` opens one.

``run.path`` (the run directory), ``run.config`` (its ``config.toml`` as a ``RunConfig``; the raw TOML tables when
the config cannot be resolved here, e.g. a plugin method that is not installed), ``run.summary`` (``summary.json``),
``run.metrics`` (one row per round: a pandas DataFrame with pandas installed, else a list of dicts),
``run.weights()`` (``weights.safetensors`` as ``{name: tensor}``, checked against the sha256 its ``summary.json``
records: ``read_weights``), ``run.results()`` (the per-round per-class and
per-client arrays of ``results.npz``: ``fedfeat.report.load.load_results``). ``run["final_acc"]`` (any summary key,
and ``run["path"]`` as a string) keeps code written for the summary dict ``train`` used to return working: a
``Run`` is a read-only mapping of its summary plus ``path``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from fedfeat.errors import FedfeatError

WEIGHTS = "weights.safetensors"
WEIGHTS_DIGEST = "weights_sha256"  # summary.json: the sha256 of weights.safetensors as the run wrote it


def weights_digest(path) -> str:
    """The sha256 (hex) of the file ``path`` (``summary.json``'s ``weights_sha256`` for ``weights.safetensors``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_classes(rows: list[dict]) -> int | None:
    """The number of classes of a run's store, from its metric rows (``per_class_acc``); None without them."""
    for r in rows:
        pc = r.get("per_class_acc") if isinstance(r, dict) else None
        if isinstance(pc, list) and pc:
            return len(pc)
    return None


def read_weights(run_dir, summary: dict, *, method: str | None = None, classes: int | None = None,
                 dim: int | None = None) -> dict:  # fmt: skip
    """``RUN/weights.safetensors`` as ``{name: CPU tensor}``, read once and checked; every failure is one
    ``FedfeatError`` line ending "re-run the run".

    * A run that records ``weights_sha256`` (``summary.json``; runs since issue 36): the file's bytes must hash to
      it -- a changed, truncated or damaged file (one flipped bit) is refused before it is parsed.
    * A run made before the digest existed: read without it, but weights with a NaN or an infinity are refused
      (nothing tells a damaged file from the run's own).
    * Either way, a linear head (``method`` a ``LinearHead``) must be ``W`` [``classes``, ``dim``] and ``b``
      [``classes``] (each checked where given: the run's class count from its metric rows, ``run_classes``; the
      feature dimension from its store)."""
    import torch
    from safetensors.torch import load as load_bytes

    run_dir = Path(os.fspath(run_dir))
    p = run_dir / WEIGHTS
    if not os.path.lexists(p):
        why = summary.get("weights")
        raise FedfeatError(f"run {run_dir} has no {WEIGHTS}" + (f": {why}" if why else "; re-run it"))
    if not p.is_file():  # a FIFO would block, a directory is no file
        raise FedfeatError(f"{p} is not a regular file; re-run the run")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FedfeatError(f"cannot read {p} ({e.strerror or e}); re-run the run") from None
    want = summary.get(WEIGHTS_DIGEST)
    if want is not None:
        have = hashlib.sha256(data).hexdigest()
        if have != want:
            raise FedfeatError(
                f"{WEIGHTS} of run {run_dir} does not match its recorded digest (summary.json {WEIGHTS_DIGEST} "
                f"{str(want)[:16]}..., the file's {have[:16]}...: changed or damaged since the run wrote it); "
                "re-run the run"
            )
    try:
        tensors = load_bytes(data)
    except Exception as e:  # safetensors' own errors: a truncated or damaged file
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FedfeatError(f"cannot read {p} ({why}); re-run the run") from None
    if want is None:
        bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise FedfeatError(
                f"{WEIGHTS} of run {run_dir} holds NaN or infinite values ({', '.join(bad[:3])}) and records no "
                f"digest ({WEIGHTS_DIGEST}: a run made before weights carried one) to vouch for them; re-run the run"
            )
    if method is not None:
        _check_head(run_dir, tensors, method, classes, dim)
    return tensors


def _check_head(run_dir: Path, tensors: dict, method: str, classes: int | None, dim: int | None) -> None:
    """A linear head's ``W`` [K, D] and ``b`` [K] against the run's class count and feature dimension."""
    try:
        from fedfeat.methods import REGISTRY
        from fedfeat.methods.head import LinearHead
    except ImportError:  # pragma: no cover - a fedfeat without methods
        return
    cls = REGISTRY.get(method)
    if cls is None or not issubclass(cls, LinearHead):
        return
    W, b = tensors.get("W"), tensors.get("b")
    want_w = f"[{classes if classes is not None else 'K'}, {dim if dim is not None else 'D'}]"
    want_b = f"[{classes if classes is not None else 'K'}]"
    ok = (
        W is not None
        and b is not None
        and W.ndim == 2
        and b.ndim == 1
        and b.shape[0] == W.shape[0]
        and (classes is None or W.shape[0] == classes)
        and (dim is None or W.shape[1] == dim)
    )
    if not ok:
        got = ", ".join(f"{k} {list(tensors[k].shape)}" for k in ("W", "b") if k in tensors) or "no W and b"
        raise FedfeatError(
            f"{WEIGHTS} of run {run_dir} does not fit the run: {method}'s head is W {want_w} and b {want_b} "
            f"(its classes, its store's feature dimension), the file has {got}; re-run the run"
        )


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
        """The final global parameters, ``{name: torch.Tensor}`` (safetensors: loading runs no code), checked
        (``read_weights``): against the digest ``summary.json`` records, or, for a run made before it did, finite;
        a linear head's shape against the run's classes. A run that keeps none (``zeroshot``: nothing is trained),
        or whose file fails a check, is one ``FedfeatError`` line saying why."""
        method = self.summary.get("method")
        return read_weights(
            self.path, self.summary, method=method if isinstance(method, str) else None,
            classes=run_classes(self._rows),
        )  # fmt: skip

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
