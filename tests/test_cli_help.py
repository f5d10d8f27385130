"""Every command's ``--help`` prints each option's help text as written: square brackets are literal text
(``pip install fedfeat[tensorboard]``, "[grid] value lists"), not rich markup tags that would vanish."""

import re

import pytest
import typer.main
from typer.testing import CliRunner

from fedfeat.cli.app import app

runner = CliRunner()
GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@pytest.mark.parametrize("name", COMMANDS)
def test_help_keeps_bracketed_text(name):
    cmd = GROUP.commands[name]
    r = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    shown = _words(r.output)
    bracketed = [
        m.group(0)
        for p in cmd.params
        for m in re.finditer(r"\S*\[[^\]\s]*\]\S*", getattr(p, "help", None) or "")
    ]
    missing = [b for b in bracketed if _words(b) not in shown]
    assert not missing, f"fedfeat {name} --help lost: {missing}"


def test_known_bracketed_help():
    """The two cases a user reported: the extras' install command and the grid file's sections."""
    out = _words(runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output)
    assert "pip install fedfeat[tensorboard]" in out and "pip install fedfeat[wandb]" in out
    out = _words(runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"}).output)
    assert "[fixed] settings, [grid] value lists, [[cells]]" in out
