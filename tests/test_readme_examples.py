"""Every ```python block of README.md runs as written, in order, in one namespace (as a reader pastes them into one
session), in a temporary directory that holds small synthetic stores at the README's own paths.

What the test changes, all listed here:

* ``SUBSTITUTIONS``: text replaced in a block before it runs, only where the README's value cannot be used on a
  small store (each entry says why).
* The fused CPU kernels' first compile (~25 s on a fresh machine, cached on disk afterwards) is kept out by the
  torch kernel as the default ``kernel`` setting for this test (``fedfeat.runs.config.DEFAULTS``); the README's code
  does not name a kernel, so it runs unchanged.
* A block containing ``# not run as a test: <why>`` is skipped (keep that rare).
* A block that needs an optional extra that is not installed (``ModuleNotFoundError``, or fedfeat's one-line
  ``pip install ...`` error) is skipped, naming it.
"""

import importlib.util
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARK = "# not run as a test:"
OPTIONAL = ("pandas", "flwr", "flwr_datasets", "datasets")  # extras a block may need

# README text -> what the test runs instead, and why
SUBSTITUTIONS = {
    # the Flower block's stored partition: 100 Dirichlet(0.1) clients of >= 10 samples each cannot be drawn from a
    # store of 1,000 train rows; the test stores 10 clients under the same scheme
    '"dirichlet-a0.1-c100-s19940817"': '"dirichlet-a0.1-c10-s19940817"',
}

runner = CliRunner()


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block."""
    out = []
    for m in re.finditer(r"^```python[ \t]*\n(.*?)^```", text, flags=re.S | re.M):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def _synth(path: str, *args: str) -> None:
    r = runner.invoke(app, ["synth", "--out", path, "--templates", "2", "--no-stats", *args])
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The README's stores, small: cache/synth-cifar10.zarr (10 classes, 8 dimensions) and, for the Flower block when flwr-datasets is installed, cache/cifar10/RN50-openai.zarr with its
    stored partition."""
    d = tmp_path_factory.mktemp("readme")
    old = Path.cwd()
    os.chdir(d)
    try:
        # CIFAR-10's 5,000 train rows per class (the default Dirichlet(0.1) over 100 clients of >= 10 rows needs
        # about that many), 8 dimensions, 10 test rows per class: ~2 s
        _synth(
            "cache/synth-cifar10.zarr", "--dim", "8", "--train-per-class", "5000", "--test-per-class", "10"
        )
        if importlib.util.find_spec("flwr_datasets") is not None:
            store = "cache/cifar10/RN50-openai.zarr"
            _synth(store, "--dim", "8", "--train-per-class", "100", "--test-per-class", "5")
            r = runner.invoke(
                app, ["partition", store, "--scheme", "dirichlet", "--alpha", "0.1", "--clients", "10"]
            )
            assert r.exit_code == 0, r.output
    finally:
        os.chdir(old)
    return d


@pytest.fixture(scope="module")
def namespace():
    """One namespace for all blocks; the methods a block registers are removed afterwards."""
    from fedfeat.methods import REGISTRY

    before = set(REGISTRY)
    yield {"__name__": "readme_example"}
    for name in set(REGISTRY) - before:
        REGISTRY.pop(name, None)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2 and any("fedfeat.train(" in code for _, code in BLOCKS)
    for old in SUBSTITUTIONS:  # a substitution whose text the README no longer has is stale
        assert any(old in code for _, code in BLOCKS), f"stale substitution {old!r}"


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_python_block_runs(line, code, workdir, namespace, monkeypatch):
    if SKIP_MARK in code:
        why = code.split(SKIP_MARK, 1)[1].splitlines()[0].strip()
        pytest.skip(f"README.md:{line}: {why}")
    for old, new in SUBSTITUTIONS.items():
        code = code.replace(old, new)
    from fedfeat.runs import config

    monkeypatch.setitem(config.DEFAULTS, "kernel", "torch")  # no first-use numba compile (module docstring)
    monkeypatch.chdir(workdir)
    ran = namespace.setdefault("__readme_blocks_run__", set())
    for (
        earlier,
        prior,
    ) in BLOCKS:  # a reader runs the blocks in order: any earlier one this worker has not run
        if (
            earlier < line and earlier not in ran and SKIP_MARK not in prior
        ):  # (pytest-xdist splits the module)
            for old, new in SUBSTITUTIONS.items():
                prior = prior.replace(old, new)
            try:
                exec(compile(prior, f"README.md:{earlier}", "exec"), namespace)  # noqa: S102
            except ModuleNotFoundError as e:  # an optional extra not installed: that block's own test skips
                if (e.name or "").split(".")[0] not in OPTIONAL:
                    raise
            except FedfeatError as e:
                if not ("pip install" in str(e) and "not installed" in str(e)):
                    raise
            ran.add(earlier)
    ran.add(line)
    try:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 -- the README's own code
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"README.md:{line} needs {e.name} (not installed)")
        raise
    except FedfeatError as e:
        if "pip install" in str(e) and "not installed" in str(e):
            pytest.skip(f"README.md:{line}: {e}")
        raise
