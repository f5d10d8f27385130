"""A plain ``import open_clip`` works in the environment ``make install`` builds (issue 35: it died with
``operator torchvision::nms does not exist`` on the CPU torch, and the README never said to go through fedfeat's
remedy). ``fedfeat.encoders.tvhook`` applies the remedy as an import hook before torchvision's first import."""

import subprocess
import sys

from fedfeat.encoders import tvhook


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_plain_import_open_clip_works_in_this_environment():
    """What a researcher types first. Fails where the hook is missing and torchvision needs the remedy: run
    ``python -m fedfeat.encoders.tvhook --install`` (``make install`` does)."""
    r = _py("import open_clip; print(open_clip.create_model.__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "create_model", r.stderr[-2000:]


def test_the_hook_applies_the_remedy_before_torchvision_and_then_leaves():
    """The finder, installed by hand in a fresh process (as the .pth line does): torchvision imports, the remedy ran
    first (native or stub, never "imported": too late), and the finder removed itself after its one use."""
    r = _py(
        "import sys\n"
        "from fedfeat.encoders import tvhook, remedy\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != 'RemedyFinder']\n"
        "tvhook.install_hook(); tvhook.install_hook()\n"  # once, however often it is asked
        "n = sum(isinstance(f, tvhook.RemedyFinder) for f in sys.meta_path)\n"
        "import torchvision\n"
        "print(n, remedy._REMEDY, any(isinstance(f, tvhook.RemedyFinder) for f in sys.meta_path))\n"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    n, how, left = r.stdout.split()
    assert n == "1" and how in ("native", "stub") and left == "False"


def test_install_writes_nothing_where_torchvision_imports(tmp_path, monkeypatch):
    """``--install`` decides on the environment without the hook: where ``import torchvision`` works it leaves the
    site-packages alone; ``--uninstall`` removes the two files."""
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    (tmp_path / tvhook.PTH_NAME).write_text("import x\n")  # a stale hook is removed first
    monkeypatch.setattr(tvhook, "_torchvision_imports", lambda python: True)
    assert tvhook.main(["--install"]) == 0
    assert not list(tmp_path.iterdir())
    answers = iter([False, True])  # fails without the hook, works with it
    monkeypatch.setattr(tvhook, "_torchvision_imports", lambda python: next(answers))
    assert tvhook.main(["--install"]) == 0
    pth = (tmp_path / tvhook.PTH_NAME).read_text()
    assert pth == f"import {tvhook.MODULE_NAME}; {tvhook.MODULE_NAME}.install_hook()\n"
    assert (tmp_path / f"{tvhook.MODULE_NAME}.py").read_text() == __import__("pathlib").Path(
        tvhook.__file__
    ).read_text()
    assert tvhook.main(["--uninstall"]) == 0 and not list(tmp_path.iterdir())
