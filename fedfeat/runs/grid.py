"""Sweep grids: the grid file format, its checks and its points (``fedfeat sweep --grid``, ``fedfeat.runs.sweep``).

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

Every table, key and value is type-checked before anything is expanded (``check_grid``: one line naming the file,
the table, the key and the type). **Bounds**: a grid is counted before it is expanded (the product of its axes'
lengths, ``count_points``) and refused above ``MAX_POINTS`` (100,000: split it into several sweeps), as is a
``--seed`` range as long; tables and arrays nested deeper than ``MAX_DEPTH`` are refused (the TOML parser's
``RecursionError`` too). A grid file has no ``name``: each point's run is named by its settings (a name shared by
several points would make them one run directory; ``fedfeat.runs.sweep.same_runs`` refuses that from Python).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from fedfeat.errors import FedfeatError

# a grid's bounds (README, "Seeds, sweeps and paper tables"): refused in one line before anything is expanded
MAX_POINTS = 100_000  # grid points (the product of the axes' lengths); more: split it into several sweeps
MAX_DEPTH = 8  # nested tables / arrays in a grid (a valid one has at most 6: [[cells.NAME]] entries' params)


def _deeper_than(obj, limit: int) -> bool:
    """Whether ``obj`` nests dicts / lists more than ``limit`` deep (iterative: no recursion on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def _axis_len(v) -> int:
    return len(v) if isinstance(v, (list, tuple)) else 1


def count_points(grid=None, params=None, cells=None) -> tuple[int, list[int]]:
    """The number of points ``expand`` would make before dropping equal ones (the product of every axis's
    length: each ``[grid]`` / ``[grid.params]`` value list, the ``[[cells]]`` entries or each ``[[cells.NAME]]``
    list) and the axes' lengths; counted, never expanded."""
    sizes = [_axis_len(v) for t in (grid, params) if isinstance(t, dict) for v in t.values()]
    if isinstance(cells, dict):
        sizes += [_axis_len(v) for v in cells.values()]
    elif cells is not None:
        sizes.append(_axis_len(cells))
    n = 1
    for k in sizes:
        n *= k
    return n, [k for k in sizes if k != 1]


def _check_size(grid, params, cells, where: str) -> None:
    n, sizes = count_points(grid, params, cells)
    if n > MAX_POINTS:
        axes = " x ".join(str(k) for k in sizes[:12]) + (" x ..." if len(sizes) > 12 else "")
        raise FedfeatError(
            f"{where}: {n} grid points ({axes}), more than a sweep makes ({MAX_POINTS} at most); split it into "
            "several sweeps (e.g. one per method or per seed range) or give fewer values"
        )


def _as_list(key: str, v) -> list:
    if isinstance(v, list):
        if not v:
            raise FedfeatError(f"grid value list for {key} is empty; give at least one value")
        return v
    return [v]


def expand(grid: dict | None = None, params: dict | None = None, cells: list[dict] | None = None,
           fixed: dict | None = None, fixed_params: dict | None = None, *, log=None) -> list[tuple[dict, dict]]:  # fmt: skip
    """The grid's points as ``(settings, params)`` pairs, in a deterministic order: cells outermost, then the
    grid's keys in the order given, then its params.

    ``cells`` is a list of tables (settings that vary together; a cell's ``params`` table adds hyperparameters), or
    a dict of such lists (``[[cells.methods]]``, ``[[cells.partitions]]``), which are crossed. Every key and value
    is type-checked first (``check_grid``): a wrong one is a one-line ``FedfeatError``.

    A hyperparameter that a point's method lacks drops out of that point (``--method fedavg,fedprox --set
    mu=0.01,0.1``: fedprox twice, fedavg once), said once per method in ``log``; points that become equal are kept
    once, at the first one's place (``applicable_points``)."""
    return applicable_points(_expand(grid, params, cells, fixed, fixed_params), log=log)


def applicable_points(points: list[tuple[dict, dict]], log=None) -> list[tuple[dict, dict]]:
    """Each point with only the hyperparameters its method has (``_applicable``), points that thereby become
    equal kept once (the first); each (method, dropped keys) said once in ``log``."""
    from fedfeat.runs.config import DEFAULTS

    said: set = set()

    def once(msg: str) -> None:
        if log is not None and msg not in said:
            said.add(msg)
            log(msg)

    out, seen = [], set()
    for settings, params in points:
        ps = _applicable(settings.get("method", DEFAULTS["method"]), params, once)
        key = (repr(sorted(settings.items())), repr(sorted(ps.items())))
        if key not in seen:
            seen.add(key)
            out.append((settings, ps))
    return out


def _expand(grid, params, cells, fixed, fixed_params) -> list[tuple[dict, dict]]:
    check_grid(grid, params, cells, fixed, fixed_params, where="sweep grid")
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
    flag = "--" + key.replace("_", "-")  # the option as typed
    if typ is int and "-" in text and "," not in text and not text.startswith("-"):
        a, _, b = text.partition("-")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            raise FedfeatError(f"{flag} {text!r}: a range is two integers, e.g. 0-4") from None
        if hi < lo:
            raise FedfeatError(f"{flag} {text!r}: the range is empty (write low-high, e.g. 0-4)")
        if hi - lo + 1 > MAX_POINTS:
            raise FedfeatError(
                f"{flag} {text!r} is {hi - lo + 1} values, more than a sweep makes ({MAX_POINTS} points at most); "
                "give a shorter range or split the sweep"
            )
        return list(range(lo, hi + 1))
    out = []
    for v in (x.strip() for x in text.split(",")):
        if not v:
            raise FedfeatError(f"{flag} {text!r} has an empty value; separate values with single commas")
        try:
            out.append(typ(v))
        except ValueError:
            raise FedfeatError(f"{flag}: {v!r} is not a {typ.__name__}") from None
    return out


_GRID_EXAMPLE = (
    "pass a grid TOML file: [fixed] settings, [grid] value lists, [[cells]] tables (fedfeat/runs/grid.py)"
)
TABLES = ("fixed", "grid", "cells")


def read_grid(path: str | os.PathLike) -> dict:
    """A grid TOML file (module docstring) -> ``expand``'s keyword arguments. Every table, key and value is
    type-checked (``check_grid``): a wrong one is one line naming the file, the table, the key and the type."""
    from fedfeat.runs.config import read_toml, short, toml_kind

    p = Path(path)
    where = f"grid file {p}"
    data = read_toml(p, "grid file", _GRID_EXAMPLE)  # too deep for the TOML parser: one line there
    if _deeper_than(data, MAX_DEPTH):
        raise FedfeatError(
            f"{where}: arrays or tables nested deeper than a grid's {MAX_DEPTH} levels; give [grid] lists of "
            "plain values (e.g. seed = [0, 1]) and [[cells]] tables of settings"
        )
    unknown = set(data) - set(TABLES)
    if unknown:
        raise FedfeatError(f"{where}: unknown tables {sorted(unknown)}; use [fixed], [grid], [[cells]]")
    for t in ("fixed", "grid"):
        if not isinstance(data.get(t, {}), dict):
            v = data[t]
            raise FedfeatError(
                f"{where}: {t} = {short(v)} is {toml_kind(v)}, but [{t}] is a table of settings "
                f"(e.g. [{t}] then {'seed = [0, 1]' if t == 'grid' else 'rounds = 10'})"
            )
    fixed, grid = dict(data.get("fixed", {})), dict(data.get("grid", {}))
    for t, tbl in (("fixed", fixed), ("grid", grid)):
        if not isinstance(tbl.get("params", {}), dict):
            v = tbl["params"]
            raise FedfeatError(
                f"{where} [{t}]: params = {short(v)} is {toml_kind(v)}, but [{t}.params] is a table of "
                "hyperparameters (e.g. [{t}.params] then lr = 0.01)".replace("{t}", t)
            )
    kw = {
        "grid": {k: v for k, v in grid.items() if k != "params"},
        "params": grid.get("params", {}),
        "cells": data.get("cells"),
        "fixed": {k: v for k, v in fixed.items() if k != "params"},
        "fixed_params": fixed.get("params", {}),
    }
    check_grid(**kw, where=where)
    return kw


def _settings(tbl: dict, where: str, axis: bool) -> None:
    """Run settings: known keys, each value of its type (``axis``: a value or a non-empty list of values)."""
    from fedfeat.runs.config import DEFAULTS, TYPES, check_setting, key_text, short
    from fedfeat.spec import SWEEP_FIXED, SWEEPABLE

    for k, v in tbl.items():
        if k not in DEFAULTS:
            valid = sorted(x for x in DEFAULTS if x in SWEEPABLE or x in SWEEP_FIXED)
            raise FedfeatError(
                f"{where}: unknown key {key_text(k)}; valid: {', '.join(valid)} (and a params table)"
            )
        if k not in SWEEPABLE and not (k in SWEEP_FIXED and not axis):
            if k in SWEEP_FIXED:
                raise FedfeatError(
                    f"{where}: {key_text(k)} takes one value for the whole sweep; put it in [fixed]"
                )
            raise FedfeatError(
                f"{where}: {key_text(k)} is the sweep's to set (each run's name, a replayed store's fingerprint); "
                "drop it"
            )
        typ = TYPES.get(k, str)
        if axis and isinstance(v, str) and typ is not str:
            try:
                vals = parse_values(k, v, typ)
            except FedfeatError:
                vals = None
            eg = short(vals, 60) if vals else "[1, 2]" if typ is int else "[0.1, 0.5]"
            raise FedfeatError(
                f"{where}: {k} = {short(v)} is a string, but {k} takes a list of "
                f"{'integers' if typ is int else 'numbers'} (e.g. {k} = {eg})"
            )
        if isinstance(v, list) and axis:
            if not v:
                raise FedfeatError(f"{where}: {k} = [] is empty; give at least one value (e.g. {k} = [...])")
            for i, x in enumerate(v):
                check_setting(k, x, where, shown=f"{k}[{i}]")
        elif isinstance(v, list) and v and not all(isinstance(x, dict) for x in v):
            raise FedfeatError(
                f"{where}: {k} = {short(v)} is an array, but {k} takes one value here; a list of values to "
                "sweep belongs in [grid]"
            )
        else:
            check_setting(k, v, where)


def _params(tbl, where: str, axis: bool, methods, label: str = "params") -> None:
    """Hyperparameters: a table of scalars (``axis``: or non-empty lists of scalars), typed as each of
    ``methods`` that has the key wants."""
    from fedfeat.runs.config import check_method_params, check_param_value, key_text, short, toml_kind

    if not isinstance(tbl, dict):
        raise FedfeatError(
            f"{where}: params = {short(tbl)} is {toml_kind(tbl)}, but params is a table of hyperparameters "
            "(e.g. params = { lr = 0.01 })"
        )
    for k, v in tbl.items():
        if not isinstance(k, str) or not k:
            raise FedfeatError(f"{where}: params has an empty key; name each hyperparameter")
        vals = v if axis and isinstance(v, list) else [v]
        if not vals:
            raise FedfeatError(f"{where}: params {key_text(k)} = [] is empty; give at least one value")
        for x in vals:
            check_param_value(k, x, f"{where} {label}".strip())
            check_method_params(methods, {k: x}, f"{where} {label}".strip())


def check_grid(grid=None, params=None, cells=None, fixed=None, fixed_params=None, *, where: str) -> None:
    """``expand``'s arguments, checked: tables where tables belong, known setting names with values of their
    types (``[grid]``: a value or a non-empty list), hyperparameters as scalars of the types their methods want,
    ``cells`` a non-empty list of tables or a table of such lists. One line naming ``where``, the table, the key
    and the type expected."""
    from fedfeat.runs.config import DEFAULTS, key_text, short, toml_kind

    if _deeper_than([grid, params, cells, fixed, fixed_params], MAX_DEPTH):
        raise FedfeatError(
            f"{where}: values nested deeper than a grid's {MAX_DEPTH} levels; give [grid] lists of plain values "
            "(e.g. seed = [0, 1]) and [[cells]] tables of settings"
        )
    _check_size(grid, params, cells, where)

    def table(v, name: str) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise FedfeatError(f"{where}: {name} = {short(v)} is {toml_kind(v)}, but {name} is a table")
        return v

    grid, params = table(grid, "[grid]"), table(params, "[grid.params]")
    fixed, fixed_params = table(fixed, "[fixed]"), table(fixed_params, "[fixed.params]")
    _settings(fixed, f"{where} [fixed]", axis=False)
    _settings(grid, f"{where} [grid]", axis=True)

    axes: list[tuple[str, list]] = []
    if isinstance(cells, dict):
        if not cells:
            raise FedfeatError(f"{where}: [cells] is an empty table; give [[cells.NAME]] tables or drop it")
        for name, v in cells.items():
            name = key_text(name)
            if not isinstance(v, list):
                raise FedfeatError(
                    f"{where}: cells.{name} = {short(v)} is {toml_kind(v)}, but cells.{name} takes an array of "
                    f"tables ([[cells.{name}]] entries)"
                )
            axes.append((f"[[cells.{name}]]", v))
    elif cells is not None:
        if not isinstance(cells, list):
            raise FedfeatError(
                f"{where}: cells = {short(cells)} is {toml_kind(cells)}, but cells takes an array of tables "
                '([[cells]] entries, e.g. [[cells]] then partition = "shard")'
            )
        axes.append(("[[cells]]", cells))
    cell_methods = []
    for name, entries in axes:
        if not entries:
            raise FedfeatError(f"{where}: {name} has no entries; give at least one table or drop it")
        for i, cell in enumerate(entries):
            if not isinstance(cell, dict):
                raise FedfeatError(
                    f"{where}: {name} entry {i + 1} = {short(cell)} is {toml_kind(cell)}, but each entry is a "
                    'table of settings (e.g. partition = "shard")'
                )
            _settings(
                {k: v for k, v in cell.items() if k != "params"}, f"{where} {name} entry {i + 1}", False
            )
            cell_methods.append(cell.get("method"))

    def listed(v) -> list:
        return v if isinstance(v, list) else [v]

    methods = [*listed(grid.get("method", [])), *([fixed["method"]] if "method" in fixed else [])]
    methods = list(dict.fromkeys([*methods, *(m for m in cell_methods if m is not None)]))
    methods = methods or [DEFAULTS["method"]]
    _params(params, f"{where} [grid.params]", True, methods, label="")
    _params(fixed_params, f"{where} [fixed.params]", False, methods, label="")
    for name, entries in axes:
        for i, cell in enumerate(entries):
            if "params" in cell:
                own = [cell["method"]] if "method" in cell else methods
                _params(cell["params"], f"{where} {name} entry {i + 1}", False, own)


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


def configs(points: list[tuple[dict, dict]], log=None) -> list:
    """The points' resolved ``RunConfig``s (each with only the hyperparameters its method has), as ``run_sweep``
    runs them."""
    from fedfeat.runs.config import DEFAULTS, resolve_config

    out = []
    for settings, params in points:
        ps = _applicable(settings.get("method", DEFAULTS["method"]), params, log or (lambda *a: None))
        out.append(resolve_config(settings, None, [f"{k}={v}" for k, v in ps.items()]))
    return out


__all__ = [
    "MAX_DEPTH",
    "MAX_POINTS",
    "applicable_points",
    "check_grid",
    "configs",
    "count_points",
    "expand",
    "parse_values",
    "read_grid",
]
