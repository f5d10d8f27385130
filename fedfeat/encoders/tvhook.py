"""A plain ``import open_clip`` (or ``import torchvision``) in an environment whose torchvision wheel was built for
another torch: the torchvision remedy (``fedfeat.encoders.remedy``) applied by an import hook, before torchvision's
first import, in every Python process of that environment.

fedfeat itself always imports open_clip through ``remedy.import_open_clip()``; this hook is for the researcher who
checks features by hand (``python -c "import open_clip"``, a notebook) in the virtual environment ``make install``
builds. ``make install`` runs ``python -m fedfeat.encoders.tvhook --install``, which does nothing where
``import torchvision`` already works, and otherwise writes two files into the environment's site-packages:

* ``_fedfeat_tvhook.py``: a copy of this module;
* ``fedfeat-torchvision-remedy.pth``: one line, ``import _fedfeat_tvhook``, which Python's ``site`` runs at start-up.

At start-up the hook only puts a finder first on ``sys.meta_path`` (no torch import, ~0.1 ms). The first time
anything imports ``torchvision``, the finder removes itself, applies the remedy, and lets the normal import go on.
``python -m fedfeat.encoders.tvhook --uninstall`` removes both files.
"""

from __future__ import annotations

import sys

PTH_NAME = "fedfeat-torchvision-remedy.pth"
MODULE_NAME = "_fedfeat_tvhook"


class RemedyFinder:
    """A meta-path finder that applies the torchvision remedy just before ``torchvision`` is first imported."""

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002 - the finder protocol
        if name != "torchvision":
            return None
        try:
            sys.meta_path.remove(self)  # once; and the remedy's own find_spec must not come back here
        except ValueError:
            pass
        try:
            from fedfeat.encoders.remedy import apply_torchvision_remedy

            apply_torchvision_remedy()
        except Exception:  # fedfeat uninstalled or torch broken: let the import fail as it would have
            pass
        return None  # the normal finders import torchvision


def install_hook() -> None:
    """Put the finder first on ``sys.meta_path`` (what the ``.pth`` line does at start-up)."""
    if not any(isinstance(f, RemedyFinder) or type(f).__name__ == "RemedyFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, RemedyFinder())


def _torchvision_imports(python: str) -> bool:
    import subprocess

    r = subprocess.run([python, "-c", "import torchvision"], capture_output=True, text=True)
    return r.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """``--install`` / ``--uninstall`` the hook in this interpreter's site-packages; prints what it did."""
    import argparse
    import shutil
    import sysconfig
    from pathlib import Path

    ap = argparse.ArgumentParser(
        prog="python -m fedfeat.encoders.tvhook", description=__doc__.split("\n\n")[0]
    )
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--install", action="store_true", help="install the hook if `import torchvision` fails")
    g.add_argument("--uninstall", action="store_true", help="remove the hook's two files")
    args = ap.parse_args(argv)
    site = Path(sysconfig.get_paths()["purelib"])
    pth, mod = site / PTH_NAME, site / f"{MODULE_NAME}.py"
    if args.uninstall:
        for f in (pth, mod):
            f.unlink(missing_ok=True)
        print(f"torchvision remedy hook: removed from {site}")
        return 0
    for f in (pth, mod):  # decide on the environment as it is without the hook
        f.unlink(missing_ok=True)
    if _torchvision_imports(sys.executable):
        print("torchvision remedy hook: not needed (import torchvision works)")
        return 0
    shutil.copyfile(Path(__file__), mod)
    pth.write_text(f"import {MODULE_NAME}; {MODULE_NAME}.install_hook()\n", encoding="utf-8")
    ok = _torchvision_imports(sys.executable)
    print(
        f"torchvision remedy hook: installed in {site} ({PTH_NAME}); import torchvision / open_clip "
        + ("now works" if ok else "STILL FAILS: see environment-notes in the README")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
