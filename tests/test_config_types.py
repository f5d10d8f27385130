"""Config and sweep grid files with wrong types (issue 26, class 5).

Every key of a ``--config`` file (run settings, ``[params]``) and of a ``sweep --grid`` file (``[fixed]``,
``[grid]``, ``[[cells]]``, their ``params``) is type-checked before use: a wrong one is ONE line (exit status 2)
naming the file, the table and key, and the type it takes; never a TypeError/AttributeError traceback. The
documented forms keep working. Then a property test: random TOML documents (random nesting of tables, arrays
and scalars of random types under the valid keys and random ones) given as ``--config`` and as ``--grid``: rc 0
(valid by chance) or rc != 0 with exactly one line and no traceback.
"""

import datetime
import json
import math
import os
import re
from pathlib import Path

import pytest
import tomllib
from helpers_clip import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedfeat.errors import FedfeatError
from fedfeat.runs import sweep as sw
from fedfeat.runs.config import DEFAULTS, resolve_config


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny synthetic store (3 classes, D = 8, 60 training samples), and a working folder as the cwd (the
    default store ``cache/synth-cifar10.zarr`` and ``runs/`` do not exist there)."""
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    d = tmp_path_factory.mktemp("cfgtypes")
    p = SynthParams(classes=3, dim=8, train_per_class=20, test_per_class=5, templates=2)
    write_synthetic_store(d / "s.zarr", p, stats=False, log=lambda *a: None)
    old = os.getcwd()
    os.chdir(d)
    yield d
    os.chdir(old)


def one_line_error(r) -> str:
    """The CLI ended with exit status 2 and exactly one line, ``error: ...``, and no traceback."""
    assert isinstance(r.exception, SystemExit), (r.exception, r.output)
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def write(d: Path, name: str, text: str | bytes) -> Path:
    p = d / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def train_args(work: Path, cfg: Path, *extra) -> list:
    return ["train", "--config", cfg, "--out", work / "runs", "--quiet", *extra]


# ---------------------------------------------------------------------------------------- --config files
RUN = '[run]\nstore = "{store}"\nmethod = "fedavg"\nclients = 2\nparticipation = 1.0\nrounds = 1\n'
CONFIG_CASES = [
    # (name, text, what the line must name besides the file)
    ("params-number", "params = 3", ["params = 3", "an integer", "table of hyperparameters"]),
    ("params-array", "params = [1, 2]", ["params", "an array", "table"]),
    ("params-array-of-tables", "[[params]]\nlr = 1", ["params", "an array of tables", "table"]),
    ("run-number", "run = 3", ["run = 3", "an integer", "[run] is a table"]),
    ("run-string", 'run = "fast"', ['run = "fast"', "a string", "[run] is a table"]),
    ("run-array-of-tables", "[[run]]\nrounds = 1", ["run", "an array of tables"]),
    ("rounds-bool", RUN + "eval_every = true", ["eval_every = true", "a boolean", "an integer"]),
    ("rounds-string", RUN.replace("rounds = 1", 'rounds = "ten"'), ["rounds", "a string", "an integer"]),
    ("rounds-float", RUN.replace("rounds = 1", "rounds = 1.5"), ["rounds = 1.5", "a number", "an integer"]),
    ("rounds-table", RUN.replace("rounds = 1", "rounds = { a = 1 }"), ["rounds", "a table", "an integer"]),
    ("rounds-huge", RUN.replace("rounds = 1", "rounds = 99999999999999999999"), ["rounds", "64 bits"]),
    ("alpha-string", RUN + 'alpha = "0.1"', ["alpha", "a string", "a number"]),
    ("alpha-array", RUN + "alpha = [0.1, 0.5]", ["alpha", "an array", "a number"]),
    ("method-array", RUN.replace('method = "fedavg"', 'method = ["fedavg"]'), ["method", "a string"]),
    ("name-date", RUN + "name = 1979-05-27", ["name", "a date/time", "a string"]),
    ("store-number", RUN.replace('"{store}"', "3"), ["store = 3", "a string"]),
    ("nested-run", RUN + "[run.extra]\na = 1", ["unknown keys ['extra']", "[run]"]),
    ("unknown-top", 'bogus = 1\nmethod = "fedavg"', ["unknown keys ['bogus']", "valid"]),
    ("unknown-beside-run", RUN + "[other]\na = 1", ["unknown top-level keys ['other']", "[run]"]),
    ("top-level-beside-run", "rounds = 1\n" + RUN, ["unknown top-level keys ['rounds']", "[run]"]),
    ("params-inside-run", RUN + "[run.params]\nlr = 0.1", ["unknown keys ['params']", "[run]"]),
    ("method_params", RUN + "method_params = 3", ["unknown keys ['method_params']"]),
    ("param-table", RUN + "[params]\nlr = { a = 1 }", ["[params]", "lr", "a table", "a number, a string"]),
    ("param-array", RUN + "[params]\nlr = [0.1]", ["[params]", "lr", "an array"]),
    ("param-date", RUN + "[params]\nlr = 2020-01-01", ["lr", "a date/time"]),
    (
        "param-bool-for-float",
        RUN + "[params]\nlr = true",
        ["lr = true", "a boolean", "fedavg's lr takes float"],
    ),
    ("param-string-for-float", RUN + '[params]\nlr = "fast"', ['lr = "fast"', "float"]),
    ("param-float-for-int", RUN + "[params]\nbatch_size = 2.5", ["batch_size = 2.5", "int"]),
    ("param-literal", RUN + '[params]\ninit = "bogus"', ["init", "one of"]),
    ("param-unknown", RUN + "[params]\nzzz = 1", ["no hyperparameter zzz;", "valid keys"]),
    ("param-huge", RUN + "[params]\nbatch_size = 99999999999999999999", ["batch_size", "64 bits"]),
    ("param-key-newline", RUN + '[params]\n"a\\nb" = [1]', ['"a\\nb" = [1]', "an array"]),  # one line
    ("unknown-key-newline", '"x\\ny" = 1', ["unknown keys ['x\\ny']"]),
    ("empty", "", ["is empty"]),
    ("comments-only", "# nothing\n\n", ["is empty"]),
    ("syntax", "[run\nrounds = 1", ["not valid TOML", "line 1"]),
    ("duplicate-key", "[run]\nrounds = 1\nrounds = 2", ["not valid TOML"]),
    ("binary", b"\x00\xff\xfe\x80garbage", ["not UTF-8"]),
    ("nul-bytes", b"rounds = 1\x00\x00", ["not valid TOML"]),
]


@pytest.mark.parametrize("name, text, says", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_config_file_wrong_types_are_one_line(work, name, text, says):
    if isinstance(text, str):
        text = text.replace("{store}", str(work / "s.zarr"))
    cfg = write(work, f"cfg-{name}.toml", text)
    line = one_line_error(run_cli(train_args(work, cfg)))
    assert str(cfg) in line, line
    for s in says:
        assert s in line, (s, line)


def test_config_file_not_a_file(work):
    line = one_line_error(run_cli(train_args(work, work)))  # a directory
    assert f"config file {work} is a directory" in line
    line = one_line_error(run_cli(train_args(work, work / "none.toml")))
    assert "not found" in line
    fifo = work / "fifo.toml"
    if not fifo.exists():
        os.mkfifo(fifo)  # would block for ever if read
    line = one_line_error(run_cli(train_args(work, fifo)))
    assert "not a regular file" in line
    big = write(work, "big.toml", "# " + "x" * (1 << 20) + "\nrounds = 1\n")
    line = one_line_error(run_cli(train_args(work, big)))
    assert "bytes, more than a TOML settings file holds" in line


def test_config_file_valid_forms_still_work(work):
    """A run's own config.toml replays; the same settings at the top level work; flags win over the file."""
    store = str(work / "s.zarr")
    cfg = write(
        work, "ok.toml", RUN.replace("{store}", store) + "seed = 3\n[params]\nlr = 0.05\nbatch_size = 8\n"
    )
    r = run_cli(train_args(work, cfg))
    assert r.exit_code == 0, r.output
    (run,) = [p for p in (work / "runs").iterdir() if "seed3" in p.name]
    replay = resolve_config({}, run / "config.toml", None)
    assert replay.seed == 3 and replay.rounds == 1 and replay.params["lr"] == 0.05
    assert replay.params["batch_size"] == 8 and "normalize" in replay.params  # every hyperparameter, resolved
    top = write(work, "top.toml", f'store = "{store}"\nmethod = "fedavg"\nalpha = 1\n[params]\nlr = 1\n')
    c = resolve_config({"rounds": 2}, top, ["lr=0.5"])
    assert (c.alpha, c.rounds, c.params["lr"]) == (1, 2, "0.5")
    # a file's [params] are checked against the method the flags choose: named with the file
    with pytest.raises(FedfeatError, match=r"top.toml \[params\]: method zeroshot has no hyperparameter lr;"):
        resolve_config({"method": "zeroshot"}, top, None)


# ---------------------------------------------------------------------------------------- grid files
FIXED = '[fixed]\nstore = "{store}"\nmethod = "fedavg"\nclients = 2\nparticipation = 1.0\nrounds = 1\n'
GRID_CASES = [
    ("fixed-number", "fixed = 1", ["fixed = 1", "an integer", "[fixed] is a table"]),
    ("grid-string", 'grid = "x"', ['grid = "x"', "a string", "[grid] is a table"]),
    ("grid-array-of-tables", "[[grid]]\nseed = 1", ["grid", "an array of tables", "[grid] is a table"]),
    ("cells-number", "cells = 3", ["cells = 3", "an integer", "array of tables"]),
    ("cells-string", 'cells = "shard"', ["cells", "a string", "array of tables"]),
    (
        "cells-array-of-numbers",
        "cells = [1, 2]",
        ["[[cells]] entry 1 = 1", "an integer", "table of settings"],
    ),
    ("cells-empty", "cells = []", ["[[cells]] has no entries"]),
    (
        "cells-table-of-scalar",
        FIXED + '[cells]\npartition = "shard"',
        ["cells.partition", "a string", "array of tables"],
    ),  # fmt: skip
    ("cells-axis-empty", FIXED + "[cells]\na = []", ["[[cells.a]] has no entries"]),
    ("cells-axis-numbers", FIXED + "[cells]\na = [1]", ["[[cells.a]] entry 1 = 1", "an integer"]),
    ("cells-empty-table", FIXED + "[cells]", ["[cells] is an empty table"]),
    (
        "seed-range-string",
        FIXED + '[grid]\nseed = "0-4"',
        ['seed = "0-4" is a string', "a list of integers", "seed = [0, 1, 2, 3, 4]"],
    ),  # fmt: skip
    ("seed-list-string", FIXED + '[grid]\nseed = "0,1"', ["a list of integers", "seed = [0, 1]"]),
    ("alpha-string", FIXED + '[grid]\nalpha = "lots"', ["alpha", "a list of numbers"]),
    (
        "seed-string-elements",
        FIXED + '[grid]\nseed = ["0", "1"]',
        ['seed[0] = "0"', "a string", "an integer"],
    ),
    ("seed-nested", FIXED + "[grid]\nseed = [[0, 1]]", ["seed[0] = [0, 1]", "an array", "an integer"]),
    ("seed-tables", FIXED + "[[grid.seed]]\na = 1", ["seed[0]", "a table", "an integer"]),
    ("seed-bool", FIXED + "[grid]\nseed = [true]", ["seed[0] = true", "a boolean"]),
    ("seed-empty", FIXED + "[grid]\nseed = []", ["seed = [] is empty"]),
    ("seed-huge", FIXED + "[grid]\nseed = [1, 99999999999999999999]", ["seed[1]", "64 bits"]),
    ("alpha-bool", FIXED + "[grid]\nalpha = true", ["alpha = true", "a boolean", "a number"]),
    ("method-number", FIXED + "[grid]\nmethod = [1]", ["method[0] = 1", "a string"]),
    (
        "fixed-rounds-list",
        FIXED.replace("rounds = 1", "rounds = [1, 2]"),
        ["rounds", "an array", "belongs in [grid]"],
    ),  # fmt: skip
    ("fixed-rounds-string", FIXED.replace("rounds = 1", 'rounds = "1"'), ["[fixed]", "rounds", "a string"]),
    ("fixed-unknown", FIXED + "zzz = 1", ["[fixed]", "unknown key zzz;", "valid"]),
    ("grid-unknown", FIXED + "[grid]\nzzz = [1]", ["[grid]", "unknown key zzz;"]),
    ("cell-unknown", FIXED + "[[cells]]\nzzz = 3", ["[[cells]] entry 1", "unknown key zzz;"]),
    ("cell-rounds-string", FIXED + '[[cells]]\nrounds = "3"', ["[[cells]] entry 1", "rounds", "a string"]),
    ("cell-rounds-list", FIXED + "[[cells]]\nrounds = [3]", ["[[cells]] entry 1", "rounds", "an array"]),
    (
        "grid-params-number",
        FIXED + "[grid]\nparams = 3",
        ["[grid]", "params = 3", "[grid.params] is a table"],
    ),
    ("fixed-params-string", FIXED + 'params = "x"', ["[fixed]", "params", "[fixed.params] is a table"]),
    ("cell-params-number", FIXED + "[[cells]]\nparams = 3", ["[[cells]] entry 1", "params = 3", "a table"]),
    ("cell-params-array", FIXED + "[[cells]]\nparams = [1]", ["[[cells]] entry 1", "params", "an array"]),
    ("grid-param-table", FIXED + "[grid.params]\nlr = { a = 1 }", ["[grid.params]", "lr", "a table"]),
    ("grid-param-nested", FIXED + "[grid.params]\nlr = [[0.1]]", ["[grid.params]", "lr = [0.1]", "an array"]),
    ("grid-param-empty", FIXED + "[grid.params]\nlr = []", ["[grid.params]", "lr = [] is empty"]),
    (
        "grid-param-type",
        FIXED + '[grid.params]\nlr = [0.1, "fast"]',
        ['lr = "fast"', "fedavg's lr takes float"],
    ),
    (
        "fixed-param-type",
        FIXED + "[fixed.params]\nbatch_size = 1.5",
        ["[fixed.params]", "batch_size = 1.5", "int"],
    ),  # fmt: skip
    (
        "cell-param-type",
        FIXED + '[[cells]]\nmethod = "fedntd"\nparams = { lr = true }',
        ["[[cells]] entry 1 params", "lr = true", "fedntd's lr"],
    ),  # fmt: skip
    ("grid-param-date", FIXED + "[grid.params]\nlr = 2020-01-01", ["lr", "a date/time"]),
    ("unknown-table", "[grids]\nmethod = ['fedavg']", ["unknown tables ['grids']"]),
    ("key-newline", FIXED + '"a\\nb" = 1', ['unknown key "a\\nb"']),  # one line
    ("cells-key-newline", FIXED + '[cells]\n"x\\ny" = 3', ['cells."x\\ny" = 3']),
    ("param-key-newline", FIXED + '[grid.params]\n"a\\nb" = []', ['params "a\\nb" = [] is empty']),
    ("empty", "", ["is empty"]),
    ("syntax", "[grid\n", ["not valid TOML"]),
    ("binary", b"\xff\xd8\xff\xe0JFIF", ["not UTF-8"]),
]


@pytest.mark.parametrize("name, text, says", GRID_CASES, ids=[c[0] for c in GRID_CASES])
def test_grid_file_wrong_types_are_one_line(work, name, text, says):
    if isinstance(text, str):
        text = text.replace("{store}", str(work / "s.zarr"))
    grid = write(work, f"grid-{name}.toml", text)
    line = one_line_error(run_cli(["sweep", "--grid", grid, "--out", work / "sweeps", "--quiet"]))
    assert str(grid) in line, line
    for s in says:
        assert s in line, (s, line)
    assert not (work / "sweeps").exists()  # refused before any run


def test_grid_not_a_file(work):
    assert "is a directory" in one_line_error(run_cli(["sweep", "--grid", work]))
    assert "not found" in one_line_error(run_cli(["sweep", "--grid", work / "nope.toml"]))


def test_grid_documented_forms_still_work(work):
    """The module docstring's forms: value lists, a scalar as a one-value axis, [grid.params] lists,
    [[cells]] with params, crossed [[cells.NAME]] axes; configs/demo.toml; a tiny sweep runs."""
    store = str(work / "s.zarr")
    text = FIXED.replace("{store}", store) + (
        "[grid]\nseed = [0, 1]\nalpha = 0.5\n[grid.params]\nlr = [0.01, 0.02]\n"
        '[[cells.p]]\npartition = "iid"\n[[cells.p]]\npartition = "dirichlet"\n'
        '[[cells.m]]\nmethod = "fedavg"\n[[cells.m]]\nmethod = "zeroshot"\nparams = { templates = "ensemble" }\n'
    )
    kw = sw.read_grid(write(work, "okgrid.toml", text))
    pts = sw.expand(**kw)
    assert len(pts) == 2 * 2 * (2 + 1)  # zeroshot has no lr: its points drop it and are kept once (issue 27)
    assert pts[0] == ({**kw["fixed"], "partition": "iid", "method": "fedavg", "seed": 0, "alpha": 0.5},
                      {"lr": 0.01})  # fmt: skip
    demo = sw.read_grid(Path(__file__).resolve().parents[1] / "configs" / "demo.toml")
    assert len(sw.expand(**demo)) == 2 * 6 * 5
    small = FIXED.replace("{store}", store) + "[grid]\nseed = [0, 1]\n[grid.params]\nlr = [0.1]\n"
    r = run_cli(["sweep", "--grid", write(work, "small.toml", small), "--out", work / "sw", "--quiet"])
    assert r.exit_code == 0, r.output
    assert len([p for p in (work / "sw").iterdir() if (p / "summary.json").is_file()]) == 2


def test_expand_api_checks_types():
    """``expand`` (the Python API of sweeps) checks its arguments like a grid file."""
    for kw, says in [
        ({"grid": {"seed": "0-4"}}, "sweep grid [grid]: seed"),
        ({"grid": 3}, "[grid] is a table"),
        ({"cells": [3]}, "[[cells]] entry 1 = 3"),
        ({"cells": {"a": 3}}, "cells.a = 3"),
        ({"params": {"lr": {"x": 1}}}, "lr"),
        ({"fixed": {"rounds": None}}, "rounds = None"),
        ({"fixed_params": 3}, "[fixed.params]"),
    ]:
        with pytest.raises(FedfeatError, match=re.escape(says)):
            sw.expand(**kw)


# ---------------------------------------------------------------------------------------- property test
def toml_string(s: str) -> str:
    # JSON's escapes (\n, \", \u00XX) are TOML basic-string escapes; DEL must be escaped in TOML, not in JSON
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else toml_string(k)


def toml_value(v) -> str:
    """A tiny TOML emitter (``tomli_w`` is not a dependency): scalars, dates, inline arrays and tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "inf" if v == math.inf else "-inf" if v == -math.inf else repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def toml_doc(doc: dict) -> str:
    """Top-level scalars and arrays, then tables as ``[name]`` sections and arrays of tables as ``[[name]]``."""
    head, tail = [], []
    for k, v in doc.items():
        if isinstance(v, dict):
            tail.append(
                f"[{toml_key(k)}]\n" + "".join(f"{toml_key(a)} = {toml_value(b)}\n" for a, b in v.items())
            )
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for x in v:
                tail.append(
                    f"[[{toml_key(k)}]]\n"
                    + "".join(f"{toml_key(a)} = {toml_value(b)}\n" for a, b in x.items())
                )
        else:
            head.append(f"{toml_key(k)} = {toml_value(v)}\n")
    return "".join(head) + "\n".join(tail)


RUN_KEYS = sorted(DEFAULTS)
PARAM_KEYS = ["lr", "batch_size", "local_epochs", "normalize", "init", "sampling", "self_training", "mu"]
STORE = "__STORE__"  # replaced by the test store's path: documents can get deep into a run
# random text: no path separators, no "~" and no "." (a random `out` or `name` stays inside the work folder)
TEXT = st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="/\\~.")
scalars = st.one_of(
    st.booleans(),
    st.integers(-5, 5),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.5, -1.0, math.inf]),
    st.text(TEXT, max_size=6),
    st.sampled_from(
        [
            "fedavg",
            "zeroshot",
            "fst-cbdg",
            "iid",
            "shard",
            "dirichlet",
            "cpu",
            "loop",
            "all",
            "0-4",
            "0,1",
            STORE,
            "text",
        ]
    ),  # fmt: skip
    st.dates(),
)
random_keys = st.one_of(st.text(TEXT, min_size=1, max_size=5),
                        st.sampled_from(["fixed", "grid", "cells", "run", "params", "method_params"]))  # fmt: skip
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(random_keys, c, max_size=3), max_leaves=6
)


def settings_table(axis: bool):
    val = st.one_of(values, st.lists(scalars, min_size=1, max_size=2)) if axis else values
    return st.dictionaries(st.one_of(st.sampled_from(RUN_KEYS), random_keys), val, max_size=4).flatmap(
        lambda d: st.one_of(
            st.just(d),
            st.dictionaries(st.sampled_from(PARAM_KEYS), val, max_size=2).map(lambda p: {**d, "params": p}),
        )
    )


config_docs = st.one_of(
    st.dictionaries(
        st.sampled_from(["run", "params"]) | random_keys, st.one_of(settings_table(False), values), max_size=3
    ),  # fmt: skip
    settings_table(False),  # the settings at the top level
)
grid_docs = st.dictionaries(
    st.sampled_from(["fixed", "grid", "cells"]) | random_keys,
    st.one_of(
        settings_table(False),
        settings_table(True),
        st.lists(settings_table(False), max_size=2),
        st.dictionaries(random_keys, st.lists(settings_table(False), max_size=2), max_size=2),
        values,
    ),
    max_size=3,
)


def check_cli(work: Path, doc: dict, kind: str) -> None:
    text = toml_doc(doc).replace(STORE, str(work / "s.zarr"))
    assert tomllib.loads(text) is not None  # the emitter writes TOML
    path = write(work, f"prop-{kind}.toml", text)
    if kind == "config":  # --rounds 1 and --out from the flags: a valid document runs briefly
        args = ["train", "--config", path, "--rounds", "1", "--out", work / "prop-runs", "--quiet"]
    else:
        args = ["sweep", "--grid", path, "--rounds", "1", "--out", work / "prop-runs", "--quiet"]
    r = run_cli(args)
    if r.exit_code == 0:
        return  # valid by chance
    if (
        kind == "grid" and r.exit_code == 1
    ):  # a well-typed grid whose runs fail on the data (a --val-split the
        runs_failed(r)  # tiny store cannot hold): the sweep's documented report, one line per failed run
        return
    one_line_error(r)


def runs_failed(r) -> None:
    """A sweep whose runs failed: exit status 1, ``N run(s) failed:`` and one ``  NAME: error`` line per run."""
    assert isinstance(r.exception, SystemExit) and r.exit_code == 1, (r.exception, r.output)
    assert "Traceback" not in r.output, r.output
    head, *rows = r.output.strip().splitlines()
    n = int(head.split(" run(s) failed:")[0])
    assert head == f"{n} run(s) failed:" and len(rows) == n, r.output
    assert all(row.startswith("  ") and ": " in row for row in rows), r.output


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=config_docs)
def test_random_config_files_never_traceback(work, doc):
    check_cli(work, doc, "config")


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=grid_docs)
def test_random_grid_files_never_traceback(work, doc):
    check_cli(work, doc, "grid")


# near-valid documents: the valid keys with mostly plausible values (and now and then a random one), so that
# most documents pass the file checks and go on into the run's own resolution (partition, method, store)
GOOD = {
    "method": st.sampled_from(["fedavg", "zeroshot", "fedprox", "fedntd", "fst-cbdg", "centralized", "nope"]),
    "store": st.just(STORE),
    "partition": st.sampled_from(["iid", "shard", "dirichlet", "dirichlet-equal", "disjoint-classes", "x"]),
    "alpha": st.sampled_from([0.1, 1, 0.0, -1.0, 1e308, math.inf]),
    "shards": st.integers(-1, 4),
    "imbalance_factor": st.sampled_from([0.5, 1, 10.0, 1e9]),
    "partition_seed": st.integers(-(2**63), 2**63 - 1),
    "clients": st.integers(-1, 8),
    "participation": st.sampled_from([0.0, 0.5, 1, 1.5]),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "engine": st.sampled_from(["batched", "loop", "x"]),
    "kernel": st.sampled_from(["auto", "fused", "torch", "x"]),
    "device": st.sampled_from(["cpu", "auto", "x"]),
    "eval_every": st.integers(-1, 3),
    "val_split": st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    "shots": st.integers(-1, 3),
    "local_test": st.sampled_from(["none", "proportional", "joint", "x"]),
    "class_order": st.sampled_from(["store", "preset", "x"]),
    "preset": st.sampled_from(["caltech101", "x"]),
    "name": st.text(TEXT, max_size=4),
    "shot_thresholds": st.sampled_from(["10,2", "x", ""]),
}
GOOD_PARAMS = {
    "lr": st.sampled_from([0.1, 1, 0.0, -1.0, math.inf, "0.1"]),
    "batch_size": st.integers(-1, 16),
    "local_epochs": st.integers(-1, 2),
    "normalize": st.booleans(),
    "mu": st.sampled_from([0.0, 0.01, -1.0]),
}


def near_valid(keys: dict, mutate: bool = True):
    """Some of ``keys`` with plausible values; with ``mutate``, half the time one key (or a random one) then gets
    a random value."""
    good = st.fixed_dictionaries({}, optional=keys)
    if not mutate:
        return good
    bad = st.one_of(st.none(), st.tuples(st.one_of(st.sampled_from(sorted(keys)), random_keys), values))
    return st.builds(lambda d, kv: d if kv is None else {**d, kv[0]: kv[1]}, good, bad)


near_config_docs = st.builds(
    lambda run, params, wrap: {"run": run, "params": params} if wrap else {**run, "params": params},
    st.builds(lambda d, n: {"store": STORE, "clients": n, **d}, near_valid(GOOD), st.integers(2, 6)),
    near_valid(GOOD_PARAMS),
    st.booleans(),
)
near_grid_docs = st.builds(
    lambda fixed, seeds, cells: {"fixed": {"store": STORE, **fixed}, "grid": {"seed": seeds}, "cells": cells},
    near_valid({k: v for k, v in GOOD.items() if k not in ("name", "clients", "shots", "shards")}),
    st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True),
    st.lists(
        near_valid(
            {"method": GOOD["method"], "partition": GOOD["partition"], "clients": st.integers(2, 6)},
            mutate=False,
        ),
        min_size=1,
        max_size=2,
    ),  # fmt: skip
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=near_config_docs)
def test_near_valid_config_files_run_or_fail_in_one_line(work, doc):
    check_cli(work, doc, "config")


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=near_grid_docs)
def test_near_valid_grid_files_run_or_fail_in_one_line(work, doc):
    check_cli(work, doc, "grid")


@pytest.mark.parametrize(
    "key, value, says",
    [("engine", "x", "--engine must be batched or loop"), ("kernel", "gpu", "--kernel must be one of auto, fused"),
     ("device", "tpu", "--device must be auto, cpu, cuda or cuda:N"), ("partition", "dir", "--partition must be one of iid")],
)  # fmt: skip
def test_run_settings_read_only_at_training_are_refused_before_any_run(work, key, value, says):
    """A grid whose fixed settings hold a value the engine would refuse fails at once (exit 2, one line), not as
    every run failing."""
    path = write(work, f"bad-{key}.toml", toml_doc({"fixed": {"store": str(work / "s.zarr"), key: value},
                                                    "grid": {"seed": [0, 1]}}))  # fmt: skip
    r = run_cli(["sweep", "--grid", path, "--rounds", "1", "--out", work / f"bad-{key}", "--quiet"])
    assert says in one_line_error(r)
    assert not (work / f"bad-{key}").exists() or not any((work / f"bad-{key}").iterdir())
