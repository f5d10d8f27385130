"""Sweeps: a grid of runs in one process (``fedfeat sweep``, ``fedfeat.runs.sweep``).

Every grid point is an ordinary run directory (its own ``config.toml``, metrics, weights, name), made by the same
``fedfeat.runs.train.train`` as ``fedfeat train``. What a sweep adds is one process for all of them: the interpreter,
torch, the compiled CPU kernels, each store, each partition and each store's loaded features are made once and
shared (``Session``), so a grid of short runs costs its rounds, not 3-4 s of start-up per run. Finished runs
are skipped (a sweep can be re-run after an interruption and only does what is missing), unless ``overwrite``.

A grid is the cartesian product of value lists over run settings (``method``, ``seed``, ``alpha``, ...) and
method hyperparameters (``params``), times an optional list of *cells* -- settings that vary together, e.g.
partitions with their own parameters::

    # grid.toml
    [fixed]
    store = "cache/synth-cifar10.zarr"
    rounds = 10
    [grid]
    method = ["fedavg", "fst-cbdg"]
    seed = [0, 1, 2, 3, 4]
    [grid.params]
    sigma = [0.5, 1.0]            # a method without this hyperparameter skips the key (named in the log)
    [[cells]]
    partition = "shard"
    shards = 2
    [[cells]]
    partition = "dirichlet"
    alpha = 0.1

**Stacking** (default; ``fedfeat sweep --no-stack`` turns it off): the pending runs of a stackable method
(``fedavg``, ``fedprox``, ``fedntd``, ``fst-cbdg``) that read the same data -- same store, partition, batch size, local epochs,
rounds, kernel, output -- are made as one batched program along a run axis (``fedfeat.runs.stack``): their seeds,
participation and hyperparameters may differ. Each still gets its own ordinary run directory with what the same
run made alone gives (``tests/test_stack.py``: bit for bit with the fused CPU kernels, <= 1e-5 with the torch
program); its ``summary.json`` says ``stacked_runs`` (its ``seconds`` are its share of the stack's). Other runs
are made one after another in the shared process (BENCHMARKS.md, "Stacked runs", gives what each saves).
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import tomllib

from fedfeat.errors import FedfeatError
from fedfeat.runs.session import active, session


def _as_list(key: str, v) -> list:
    if isinstance(v, list):
        if not v:
            raise FedfeatError(f"grid value list for {key} is empty; give at least one value")
        return v
    return [v]


def expand(grid: dict | None = None, params: dict | None = None, cells: list[dict] | None = None,
           fixed: dict | None = None, fixed_params: dict | None = None) -> list[tuple[dict, dict]]:  # fmt: skip
    """The grid's points as ``(settings, params)`` pairs, in a deterministic order: cells outermost, then the
    grid's keys in the order given, then its params.

    ``cells`` is a list of tables (settings that vary together; a cell's ``params`` table adds hyperparameters), or
    a dict of such lists (``[[cells.methods]]``, ``[[cells.partitions]]``), which are crossed."""
    grid, params = dict(grid or {}), dict(params or {})
    axes = list(cells.values()) if isinstance(cells, dict) else [cells or [{}]]
    combos = []
    for parts in itertools.product(*axes):
        merged: dict = {}
        for cell in parts:
            if not isinstance(cell, dict):
                raise FedfeatError(
                    'each [[cells]] entry must be a table of settings, e.g. partition = "shard"'
                )
            cp = {**merged.get("params", {}), **cell.get("params", {})}
            merged = {**merged, **cell, "params": cp}
        combos.append(merged)
    keys, pkeys = list(grid), list(params)
    out = []
    for cell in combos:
        cell = dict(cell)
        cell_params = cell.pop("params", {})
        for vals in itertools.product(*(_as_list(k, grid[k]) for k in keys)):
            for pvals in itertools.product(*(_as_list(k, params[k]) for k in pkeys)):
                settings = {**(fixed or {}), **cell, **dict(zip(keys, vals))}
                out.append((settings, {**(fixed_params or {}), **cell_params, **dict(zip(pkeys, pvals))}))
    return out


def parse_values(key: str, text: str, typ=str) -> list:
    """``"0,1,2"`` or a range ``"0-4"`` (integers only) -> typed values; a one-line error names a bad one."""
    text = text.strip()
    if typ is int and "-" in text and "," not in text and not text.startswith("-"):
        a, _, b = text.partition("-")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            raise FedfeatError(f"--{key} {text!r}: a range is two integers, e.g. 0-4") from None
        if hi < lo:
            raise FedfeatError(f"--{key} {text!r}: the range is empty (write low-high, e.g. 0-4)")
        return list(range(lo, hi + 1))
    out = []
    for v in (x.strip() for x in text.split(",")):
        if not v:
            raise FedfeatError(f"--{key} {text!r} has an empty value; separate values with single commas")
        try:
            out.append(typ(v))
        except ValueError:
            raise FedfeatError(f"--{key}: {v!r} is not a {typ.__name__}") from None
    return out


def read_grid(path: str | Path) -> dict:
    """A grid TOML file (module docstring) -> ``expand``'s keyword arguments."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise FedfeatError(f"grid file {p} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FedfeatError(f"cannot read grid file {p}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise FedfeatError(f"grid file {p} is not valid TOML: {e}; fix the line it names") from None
    unknown = set(data) - {"fixed", "grid", "cells"}
    if unknown:
        raise FedfeatError(f"grid file {p}: unknown tables {sorted(unknown)}; use [fixed], [grid], [[cells]]")
    fixed = dict(data.get("fixed", {}))
    grid = dict(data.get("grid", {}))
    return {
        "grid": {k: v for k, v in grid.items() if k != "params"},
        "params": grid.get("params", {}),
        "cells": data.get("cells"),
        "fixed": {k: v for k, v in fixed.items() if k != "params"},
        "fixed_params": fixed.get("params", {}),
    }


def _applicable(method: str, params: dict, log) -> dict:
    """The params that ``method`` has (a grid over one method's hyperparameter leaves the others alone)."""
    import dataclasses

    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(method)
    if cls is None:
        return params  # get_method names the unknown method
    names = {f.name for f in dataclasses.fields(cls.Params)}
    dropped = sorted(k for k in params if k.replace("-", "_") not in names)
    if dropped:
        log(f"{method}: no hyperparameter {', '.join(dropped)}; those grid keys are skipped for it")
    return {k: v for k, v in params.items() if k.replace("-", "_") in names}


# runs per stacked program (memory: R x the virtual clients' heads, FST-CBDG's soft labels, banks)
STACK_MAX = 16


def run_sweep(
    points: list[tuple[dict, dict]],
    *,
    overwrite: bool = False,
    progress: bool = True,
    log=print,
    stack: bool = True,
) -> list[Path]:
    """Make every point's run (skipping finished ones unless ``overwrite``); returns the run directories in the
    points' order. One process, one ``Session``; with ``stack``, runs that read the same data in one program
    (module docstring)."""
    from fedfeat.runs.config import DEFAULTS, resolve_config
    from fedfeat.runs.train import run_name, stack_group, train_stacked
    from fedfeat.runs.train import train as run_train

    paths: list[Path] = []
    outer = active()
    with contextlib.nullcontext(outer) if outer is not None else session() as s:
        cfgs = []
        for settings, params in points:
            method = settings.get("method", DEFAULTS["method"])
            ps = _applicable(method, params, log)
            cfgs.append(resolve_config(settings, None, [f"{k}={v}" for k, v in ps.items()]))
        names = [run_name(c) for c in cfgs]
        seen: dict[Path, int] = {}
        for i, path in enumerate(names):
            if path in seen:
                raise FedfeatError(
                    f"grid points {seen[path] + 1} and {i + 1} are the same run ({path.name}); remove the duplicate"
                )
            seen[path] = i
        done: dict[int, Path] = {}
        pending = []
        for i, path in enumerate(names):
            if (path / "summary.json").is_file() and not overwrite:
                log(f"[{i + 1}/{len(cfgs)}] {path.name}: finished already, skipped")
                done[i] = path
            else:
                pending.append(i)
        groups: dict = {}
        for i in pending:
            g = stack_group(cfgs[i]) if stack else None
            groups.setdefault(("one", i) if g is None else g, []).append(i)
        failed = None
        for members in groups.values():
            for c0 in range(0, len(members), STACK_MAX):
                chunk = members[c0 : c0 + STACK_MAX]
                if len(chunk) == 1:
                    i = chunk[0]
                    log(f"[{i + 1}/{len(cfgs)}] {names[i].name}")
                    done[i] = run_train(cfgs[i], overwrite=overwrite, progress=progress, log=lambda *a: None)
                    continue
                log(
                    f"[{', '.join(str(i + 1) for i in chunk)}/{len(cfgs)}] {len(chunk)} runs stacked in one program"
                )
                for i, res in zip(chunk, train_stacked([cfgs[i] for i in chunk], overwrite=overwrite,
                                                       log=lambda *a: None)):  # fmt: skip
                    if isinstance(res, FedfeatError):
                        log(f"  {names[i].name}: {res}")
                        failed = failed or res
                    else:
                        done[i] = res
        if failed is not None:  # the others are written; the first error is the sweep's
            raise failed
        paths = [done[i] for i in range(len(cfgs))]
        del s
    return paths


__all__ = ["expand", "parse_values", "read_grid", "run_sweep"]
