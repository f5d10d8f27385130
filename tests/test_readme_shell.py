"""Every command of README.md's ```bash blocks runs here, is checked here, or is named as run by CI.

A command is read as a shell reads it: ``\\``-continued lines joined, the ``# ...`` comment dropped. Then, by its
first words:

* ``fedfeat ...`` that can run offline on small synthetic stores **runs as written** (through ``CliRunner``, in
  README order, in one temporary folder that holds the stores the README names: later commands read what earlier
  ones wrote). What the test changes is listed in three tables below: ``SUBSTITUTIONS`` (README text replaced, only
  where the README's value names a placeholder or cannot work on a small store; each says why), ``PREPARED``
  (what the README assumes already exists: a ``make demo`` output, a grid file, an interrupted run; made just
  before the first command that names it) and ``EXPECTED`` (what the README says a command gives, checked after
  it: a file written, a line printed). The fused CPU kernels' first compile is kept out as in
  ``tests/test_readme_examples.py`` (the torch kernel as the default; no README command names a kernel).
* ``fedfeat ...`` that cannot run here (``NOT_RUN``: real datasets, downloaded weights, a GPU, s3, minutes of
  work) is **parsed** by the real CLI: its subcommand is resolved and click's ``make_context`` checks every flag
  and value as written (a misspelt flag or a value of the wrong type fails), and its ``--method`` names are
  looked up in the method registry. ``torchrun ... -m fedfeat ...``: its fedfeat part, the same way.
* ``make demo`` / ``make test`` are what CI runs (``RUN_IN_CI``: the test checks that ``.ci/run`` runs them);
  any other ``make TARGET VARS`` is dry-run (``make -n``, which must exit 0 without installing) and the fedfeat
  commands it would run are parsed.
* ``pip install PATH`` installs the folder for real (into a temporary site folder, offline, no dependencies);
  ``pip install 'fedfeat[EXTRA]'``: the extra is declared in pyproject.toml.
* ``python examples/flower_app.py ...`` runs as written on the README's store when flwr is installed (an optional
  extra; skipped naming it otherwise).
* Anything else fails ``test_every_readme_shell_command_is_covered``, naming it: a new block is covered by itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import typer
from typer.testing import CliRunner

from fedfeat.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
runner = CliRunner()


@dataclass(frozen=True)
class Cmd:
    line: int  # README line of the command (its first line when continued)
    argv: tuple[str, ...]  # as the shell splits it, the comment dropped

    @property
    def text(self) -> str:  # what the tables below match
        return " ".join(self.argv)

    def __str__(self) -> str:
        return f"README.md:{self.line}: {self.text}"


def bash_commands(text: str) -> list[Cmd]:
    """Every command of every ```bash block, in README order."""
    out = []
    for m in re.finditer(r"^```bash[ \t]*\n(.*?)^```", text, flags=re.S | re.M):
        first = text.count("\n", 0, m.start()) + 2  # README line of the block's first line
        joined, start = "", None
        for i, raw in enumerate(m.group(1).splitlines()):
            start = first + i if start is None else start
            if raw.rstrip().endswith("\\"):  # a continued line: bash drops the backslash-newline
                joined += raw.rstrip()[:-1] + " "
                continue
            argv = shlex.split(joined + raw, comments=True)
            if argv:
                out.append(Cmd(start, tuple(argv)))
            joined, start = "", None
    return out


COMMANDS = bash_commands(README.read_text(encoding="utf-8"))

# ------------------------------------------------------------------------------------------------ the tables
# `make` commands CI runs as they are: command -> the CI script that runs it
RUN_IN_CI = {
    "make demo": "scripts/ci_demos.sh",  # with its tables' rows checked, as are make demo-clip2fl / demo-open-vocab
    "make test": ".ci/run",
}

# a `fedfeat` command starting with this text is parsed, not run: why it cannot run here
NOT_RUN = {
    "fedfeat encode": "encodes a real dataset (not in the test folder) with open_clip weights (a download); "
    "tests/test_encode.py and test_datasets_hf.py encode small fixtures with a tiny random model",
    "fedfeat train --method promptfl": "prompt learning runs the live text encoder of real CLIP weights "
    "(a download), and the README's run asks for --device cuda",
    "fedfeat train --method fedtpg": "prompt learning: the live text encoder of real CLIP weights (a download)",
    "fedfeat train --method fedcopl": "prompt learning on the stored pixels of a real encode, --device cuda",
    "fedfeat train --method zeroshot --store cache/cifar10/RN50-openai.zarr": "a real CIFAR-10 store encoded "
    "with RN50 (a dataset and a weights download); zeroshot's CLIP_benchmark JSON is tests/test_clipbench_json.py",
    "fedfeat train --store s3://": "an s3 bucket (network, credentials, s3fs); tests/test_fsspec_store.py runs "
    "the same code on memory://",
    "fedfeat reproduce fst-cbdg-table2 --synthetic --seeds 5": "195 runs and three full-size stand-in stores "
    "(the README: 2 min 43 s on 2 cores); tests/test_reproduce.py runs the tables on small stand-ins",
}


SMALL = (
    "--dim",
    "8",
    "--train-per-class",
    "2000",
    "--test-per-class",
    "10",
    "--templates",
    "2",
    "--no-stats",
)


def _one(wd: Path, pattern: str) -> str:
    """The one path matching PATTERN in the test folder."""
    hits = sorted(p.relative_to(wd).as_posix() for p in wd.glob(pattern))
    assert len(hits) == 1, f"{pattern} matches {hits}"
    return hits[0]


# README text -> (what runs instead: text, or a function of the test folder giving it; why)
SUBSTITUTIONS = {
    # the quickstart's store at its full size (50,000 x 1024, ~15 s plus ~10 s of statistics) would make every
    # later run here ~100x slower: the same 10 classes in 8 dimensions, 2,000 training rows per class (100
    # Dirichlet(0.1) clients of >= 10 rows each are drawn at once from 2,000, after ~3 s of redraws from 1,000)
    "fedfeat synth --out cache/synth-cifar10.zarr": (
        "fedfeat synth --out cache/synth-cifar10.zarr " + " ".join(SMALL),
        "a small store",
    ),
    # the second store of the combine example must have the quickstart store's shape (one encoder): the small one's
    "fedfeat synth --out cache/synth-other.zarr --classes 20 --seed 1 --no-stats": (
        "fedfeat synth --out cache/synth-other.zarr --classes 20 --seed 1 --no-stats "
        + " ".join(x for x in SMALL if x != "--no-stats"),
        "the small store's dimension and templates (fedfeat combine takes stores of one encoder)",
    ),
    # placeholders: a run directory an earlier command made
    "runs/<run>": (
        lambda wd: _one(wd, "runs/fst-cbdg__*"),
        "the run of `fedfeat train --method fst-cbdg` above",
    ),
    "runs/RUN": (
        lambda wd: _one(wd, "runs/fst-cbdg__*"),
        "the same fst-cbdg run (a finished run with weights)",
    ),
    "runs/<name>": (
        lambda wd: _one(wd, "runs/.partial-fedprox__*").replace(".partial-", ""),
        "the run PREPARED interrupted (OUT/NAME of its .partial-NAME folder)",
    ),
}


def _cli(*args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, (args, r.output)
    return r.output


def _small_store(path: str, *args: str) -> None:
    _cli("synth", "--out", path, *SMALL, *args)


def _demo_runs(wd: Path) -> None:
    """`make demo`'s output: its own sweep (Makefile, target demo) on the small store, one seed of its five (what
    `report` reads is the same; scripts/ci_demos.sh runs the whole demo)."""
    _cli("sweep", "--grid", str(ROOT / "configs/demo.toml"), "--store", "cache/synth-cifar10.zarr",
         "--out", "runs/demo", "--seed", "0", "--quiet")  # fmt: skip


def _grid_toml(wd: Path) -> None:
    """A grid file of the three sections the README's comment names."""
    (wd / "grid.toml").write_text(
        '[fixed]\nrounds = 2\nclients = 10\nout = "runs/grid"\n\n[grid]\nseed = [0, 1]\n\n'
        '[[cells.methods]]\nmethod = "fedavg"\n\n[[cells.methods]]\nmethod = "fst-cbdg"\n'
    )


def _interrupted_run(wd: Path) -> None:
    """A run stopped by Ctrl-C after round 5 of 10 (checkpoints every 2 rounds): what `--resume` continues."""
    from fedfeat.report import rundir

    def fault(name: str) -> None:
        if name == "after-round-5":
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rundir, "fault_point", fault)
        r = runner.invoke(app, ["train", "--method", "fedprox", "--checkpoint-every", "2", "--quiet"])
    assert r.exit_code == 130, r.output  # the CLI's status for Ctrl-C
    _one(wd, "runs/.partial-fedprox__*")


# README text -> (what makes it, why): things the README assumes exist when a command names them
PREPARED = {
    "runs/demo": (_demo_runs, "`make demo` (the README's first command) writes runs/demo"),
    "grid.toml": (_grid_toml, "a grid file of the user's ([fixed], [grid], [[cells]])"),
    "runs/<name>": (_interrupted_run, "an interrupted run, to resume"),
    "cache/other.zarr": (
        lambda wd: _small_store("cache/other.zarr", "--seed", "1"),
        "another store with the same classes (another generator seed: a 'domain shift')",
    ),
    "cache/cifar10/RN50-openai.zarr": (
        lambda wd: _small_store("cache/cifar10/RN50-openai.zarr"),
        "the store the Flower section's `fedfeat encode --dataset hf:... --name cifar10 --backbone RN50` writes "
        "(parsed only, NOT_RUN), small",
    ),
}


def _run_dir(out: str) -> Path:
    """The run directory a `fedfeat train` printed (`run: PATH  (...)`)."""
    m = re.search(r"^run: (\S+)", out, flags=re.M)
    assert m, out
    return Path(m.group(1))


def _expect_tb(out: str, wd: Path, args: list[str]) -> None:
    run = _run_dir(out)
    where = wd / args[args.index("--log-dir") + 1] / run.name if "--log-dir" in args else run / "tb"
    assert list(where.glob("events.out.tfevents.*")), f"no TensorBoard event file in {where}"


def _expect_flower_partition(out: str, wd: Path, args: list[str]) -> None:
    """The README's Flower Python block reads a stored partition: this command stores it, in that store."""
    m = re.search(
        r'FedfeatPartitioner\.from_store\("([^"]+)", "([^"]+)"\)', README.read_text(encoding="utf-8")
    )
    assert m, "the Flower block's from_store(STORE, KEY) is gone"
    store, key = m.groups()
    assert args[1] == store, f"the Flower block reads {store}, this command partitions {args[1]}"
    assert (wd / store / "partitions" / key).is_dir(), f"{store} holds no partition {key}: {out}"


def _expect_resumed(out: str, wd: Path, args: list[str]) -> None:
    (run,) = (wd / "runs").glob("fedprox__*")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(11)), "the resumed run does not end at round 10"
    assert not list((wd / "runs").glob(".partial-fedprox__*"))


# README text -> (check of (output, workdir, the arguments run), what the README says): after every command
# containing the text; a check fails by an assertion or by returning False
EXPECTED = {
    "--export p.json": (lambda out, wd, a: len(json.loads((wd / "p.json").read_text())) > 0, "writes p.json"),
    "--plot runs/demo/curves.pdf": (
        lambda out, wd, a: (wd / "runs/demo/curves.pdf").read_bytes().startswith(b"%PDF"),
        "draws the runs' figure as a PDF",
    ),
    "fedfeat methods": (lambda out, wd, a: "fst-cbdg" in out and "fedavg" in out, "lists the methods"),
    "--logger tensorboard": (_expect_tb, "writes event files in RUN/tb/ (tb/NAME/ with --log-dir tb/)"),
    "--logger wandb": (
        lambda out, wd, a: (_run_dir(out) / "wandb").is_dir(),
        "an offline W&B run in RUN/wandb/",
    ),
    "--format json": (lambda out, wd, a: json.loads(out) is not None, "one JSON document on stdout"),
    "--resume runs/<name>": (_expect_resumed, "continues the interrupted run to its last round"),
    "fedfeat partition cache/cifar10/RN50-openai.zarr": (
        _expect_flower_partition,
        "stores the Flower block's key",
    ),
}


def not_run_reason(c: Cmd) -> str | None:
    for prefix, why in NOT_RUN.items():
        if c.text.startswith(prefix):
            return why
    return None


def kind(c: Cmd) -> str:
    a = c.argv
    if a[0] == "fedfeat":
        return "parse" if not_run_reason(c) else "run"
    if a[0] == "make":
        return "ci" if c.text in RUN_IN_CI else "make"
    if a[:2] == ("pip", "install"):
        return "pip"
    if a[0] == "torchrun" and "fedfeat" in a:
        return "torchrun"
    if a[:2] == ("python", "examples/flower_app.py"):
        return "flower"
    return "unclassified"


def _substituted(c: Cmd, wd: Path) -> list[str]:
    """The command's arguments after ``fedfeat``, with SUBSTITUTIONS applied."""
    text = c.text
    for old, (new, _) in SUBSTITUTIONS.items():
        if old in text:
            text = text.replace(old, new if isinstance(new, str) else new(wd))
    return list(c.argv[1:]) if text == c.text else shlex.split(text)[1:]


# ------------------------------------------------------------------------------------------------ the parser
def parse_fedfeat(args: list[str], where: str) -> dict:
    """Resolve the subcommand of `fedfeat ARGS` and let click parse its flags and values as written; the
    `--method` names must be registered methods. Returns the parsed parameters."""
    from fedfeat.methods import REGISTRY

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="fedfeat")
    assert args and args[0] in group.commands, f"{where}: no fedfeat subcommand {args[:1]}"
    cmd = group.get_command(root, args[0])
    rest = [a for a in args[1:] if a != "..."]  # `...` in the README: "and the flags above"
    try:
        params = cmd.make_context(args[0], rest, parent=root).params
    except Exception as e:  # click's usage errors: an unknown flag, a bad value, a missing argument
        pytest.fail(f"{where}: `fedfeat {shlex.join(args)}` does not parse: {type(e).__name__}: {e}")
    for m in (params.get("method") or "").split(","):
        assert not m or m in REGISTRY, f"{where}: --method {m} is not a method (`fedfeat methods`)"
    return params


# ------------------------------------------------------------------------------------------------ the tests
def test_every_readme_shell_command_is_covered():
    assert len(COMMANDS) >= 40, "the README's bash blocks were not found"
    unclassified = [str(c) for c in COMMANDS if kind(c) == "unclassified"]
    assert not unclassified, (
        "README commands no test covers (add them to tests/test_readme_shell.py):\n" + "\n".join(unclassified)
    )
    texts = [c.text for c in COMMANDS]
    for table in (NOT_RUN, SUBSTITUTIONS, PREPARED, EXPECTED):
        for key in table:  # an entry whose text the README no longer has is stale
            assert any(key in t for t in texts), f"stale entry {key!r}: no README command contains it"
    for cmd in RUN_IN_CI:
        assert cmd in texts, f"stale entry {cmd!r}"
    kinds = [kind(c) for c in COMMANDS]
    assert kinds.count("run") >= 20 and kinds.count("parse") >= 10, kinds


def _install_plugin(path: str, site: Path, monkeypatch) -> list[str]:
    """`pip install PATH`, for real, into a temporary site folder (a copy of PATH: pip's build writes into it);
    returns the methods it adds."""
    import fedfeat.methods as M

    src = site.parent / "src" / Path(path).name
    shutil.copytree(ROOT / path, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    if importlib.util.find_spec("setuptools") is not None:
        pip = "-m pip install -q --no-index --no-deps --no-build-isolation --target".split()
        r = subprocess.run(
            [sys.executable, *pip, str(site), str(src)],
            capture_output=True,
            text=True,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
        assert r.returncode == 0, r.stderr
    else:  # no build backend here (no network to fetch one): what pip writes, by hand (tests/test_plugins.py)
        project = tomllib.loads((src / "pyproject.toml").read_text())["project"]
        site.mkdir(parents=True, exist_ok=True)
        for module in src.glob("*.py"):
            shutil.copy(module, site)
        info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
        )
        eps = "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items())
            for group, entries in project["entry-points"].items()
        )
        (info / "entry_points.txt").write_text(eps)
    monkeypatch.syspath_prepend(str(site))
    for module in src.glob("*.py"):  # imported afresh from the install (and forgotten after the test)
        monkeypatch.delitem(sys.modules, module.stem, raising=False)
    importlib.invalidate_caches()
    return M.load_plugins()  # what the next `fedfeat` process does when it imports fedfeat.methods


def _needs_missing_extra(out: str) -> str | None:
    m = re.search(r"pip install '?fedfeat\[(\w+)\]", out)
    return m.group(1) if m and "not installed" in out else None


def test_readme_fedfeat_commands_run_in_order(tmp_path, monkeypatch):
    """Every runnable `fedfeat` command of the README, as written, in README order, in one folder."""
    from fedfeat.methods import REGISTRY
    from fedfeat.runs import config

    wd = tmp_path / "work"
    wd.mkdir()
    monkeypatch.chdir(wd)
    monkeypatch.setitem(config.DEFAULTS, "kernel", "torch")  # no first-use numba compile (module docstring)
    # each run's own curve.png (0.2 s a run, ~100 runs here) is not drawn: no README command here reads one, and
    # tests/test_plots.py draws it; `report --plot` (another function) is drawn and checked
    monkeypatch.setattr("fedfeat.report.plots.plot_curves", lambda *a, **k: None)
    before = set(REGISTRY)
    done, ran, skipped, plugins = set(), [], [], []
    try:
        for c in COMMANDS:
            k = kind(c)
            if k == "pip" and not c.argv[2].startswith("fedfeat["):
                plugins += _install_plugin(c.argv[2], tmp_path / "site", monkeypatch)
                continue
            if k != "run":
                continue
            for key, (make, _) in PREPARED.items():
                if key in c.text and key not in done:
                    make(wd)
                    done.add(key)
            args = _substituted(c, wd)
            r = runner.invoke(app, args)
            extra = _needs_missing_extra(r.output)
            if r.exit_code != 0 and extra:  # `pip install 'fedfeat[EXTRA]'` above it was not done here
                parse_fedfeat(args, str(c))
                skipped.append(f"{c} (fedfeat[{extra}] not installed: parsed only)")
                continue
            assert r.exit_code == 0, f"{c}\nexit {r.exit_code}:\n{r.output}\n{r.exception!r}"
            for key, (check, claim) in EXPECTED.items():
                if key in c.text:
                    out = r.stdout if key == "--format json" else r.output
                    assert check(out, wd, args) is not False, (
                        f"{c}: the README says it {claim}; got:\n{r.output}"
                    )
            if c.argv[:2] == ("fedfeat", "methods"):  # "fedavg-ls is listed" once `pip install` installed it
                assert all(name in r.output for name in plugins), (plugins, r.output)
            ran.append(c)
    finally:
        for name in set(REGISTRY) - before:  # the plugin the README installs
            REGISTRY.pop(name, None)
    assert len(ran) >= 20, ran
    if skipped:
        print("parsed only:", *skipped, sep="\n  ")


PARSED = [c for c in COMMANDS if kind(c) in ("parse", "torchrun")]


@pytest.mark.parametrize("c", PARSED, ids=[f"README.md:{c.line}" for c in PARSED])
def test_readme_command_that_cannot_run_here_parses(c):
    args = list(c.argv[1:] if c.argv[0] == "fedfeat" else c.argv[c.argv.index("fedfeat") + 1 :])
    assert not_run_reason(c) or c.argv[0] == "torchrun"
    if c.argv[0] == "torchrun":  # `torchrun [its flags] -m fedfeat ...`
        assert c.argv[c.argv.index("fedfeat") - 1] == "-m", c
    params = parse_fedfeat(args, str(c))
    assert params, c


MAKES = [c for c in COMMANDS if kind(c) == "make"]


@pytest.mark.parametrize("c", MAKES, ids=[f"README.md:{c.line}" for c in MAKES])
def test_readme_make_command_dry_runs(c):
    """`make -n` of the README's command exits 0 without installing anything (`-o .venv/.installed`: the install
    counts as done), and every fedfeat command it would run parses."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    r = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", ".venv/.installed", *c.argv[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"{c}: make -n failed:\n{r.stdout}{r.stderr}"
    assert "pip install" not in r.stdout, f"{c}: the dry run would install:\n{r.stdout}"
    commands = [ln.split(" -m fedfeat ", 1)[1] for ln in r.stdout.splitlines() if " -m fedfeat " in ln]
    assert commands, f"{c}: runs no fedfeat command:\n{r.stdout}"
    for line in commands:
        parse_fedfeat(shlex.split(line, comments=True), f"{c} (make runs `fedfeat {line}`)")


def _ci_lines(path: Path) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.parametrize("cmd", sorted(RUN_IN_CI))
def test_readme_make_command_runs_in_ci(cmd):
    """.ci/run runs `make test` and scripts/ci_demos.sh, which runs `make demo`."""
    ci = _ci_lines(ROOT / ".ci/run")
    assert "make test" in ci and "bash scripts/ci_demos.sh" in ci, ci
    script = ROOT / RUN_IN_CI[cmd]
    words = [shlex.split(ln) for ln in _ci_lines(script)]
    target = cmd.split()[1]
    # `make TARGET ...` or `"${make_[@]}" TARGET ...` (make with flags kept in an array)
    assert any(w and w[0] in ("make", "${make_[@]}") and target in w[1:2] for w in words), (cmd, script)


PIPS = [c for c in COMMANDS if kind(c) == "pip"]


@pytest.mark.parametrize("c", PIPS, ids=[f"README.md:{c.line}" for c in PIPS])
def test_readme_pip_install_names_what_exists(c):
    (what,) = c.argv[2:]
    m = re.fullmatch(r"fedfeat\[([\w,]+)\]", what)
    if m:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for extra in m.group(1).split(","):
            assert extra in extras, f"{c}: pyproject.toml declares no extra {extra!r}"
    else:  # a folder: a package pip can build (its install runs in test_readme_fedfeat_commands_run_in_order)
        assert (ROOT / what / "pyproject.toml").is_file(), f"{c}: {what} is not a package folder"


FLOWER = [c for c in COMMANDS if kind(c) == "flower"]


@pytest.mark.parametrize("c", FLOWER, ids=[f"README.md:{c.line}" for c in FLOWER])
def test_readme_flower_app_runs(c, tmp_path, monkeypatch):
    """The Flower app, as written, on the store the README's quickstart makes (small here)."""
    if importlib.util.find_spec("flwr") is None:
        pytest.skip(f"{c}: needs flwr[simulation] (an optional extra, not installed)")
    store = c.argv[c.argv.index("--store") + 1]
    assert any(store in x.text and x.argv[:2] == ("fedfeat", "synth") for x in COMMANDS), (
        f"{c}: no README command makes {store}"
    )
    os.symlink(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["synth", "--out", store, "--dim", "8", "--train-per-class", "100",
                            "--test-per-class", "10", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    p = subprocess.run(
        [sys.executable, *c.argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"{c}:\n{p.stdout}\n{p.stderr}"
