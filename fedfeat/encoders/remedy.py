"""The torchvision remedy: ``import open_clip`` on a CPU torch whose torchvision wheel was built for CUDA.

The registry's torchvision is built against CUDA torch; on the CPU torch its compiled ``_C`` library fails to load
silently and ``import torchvision`` (so ``import open_clip``) dies with ``operator torchvision::nms does not
exist``. ``apply_torchvision_remedy`` runs before the first import: it tries ``torch.ops.load_library`` on
torchvision's ``_C`` and, only if that fails, defines the ``nms`` / ``qnms`` schemas in a
``torch.library.Library("torchvision", "DEF")`` kept alive here. ``import_open_clip()`` applies it and returns the
module: always import open_clip through it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

_TV_LIBRARY = None  # the stub torchvision operator library; must stay alive for the process
_REMEDY: str | None = None  # "native" | "stub" | "imported" | "absent", once applied


def _tv_op_exists() -> bool:
    try:
        return hasattr(torch.ops.torchvision, "nms")
    except (RuntimeError, AttributeError):
        return False


def apply_torchvision_remedy() -> str:
    """Make ``import torchvision`` work on a CPU torch with a torchvision wheel built for CUDA (idempotent).

    Returns what was done: ``"native"`` (torchvision's compiled ops loaded, nothing changed), ``"stub"``
    (the ``nms`` / ``qnms`` schemas were defined so torchvision's Python side imports), ``"imported"``
    (torchvision was already imported; too late to change anything) or ``"absent"`` (no torchvision).
    """
    global _REMEDY, _TV_LIBRARY
    if _REMEDY is not None:
        return _REMEDY
    if "torchvision" in sys.modules:
        _REMEDY = "imported"
        return _REMEDY
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        _REMEDY = "absent"
        return _REMEDY
    if _tv_op_exists():
        _REMEDY = "native"
        return _REMEDY
    pkg = Path(next(iter(spec.submodule_search_locations)))
    for lib in sorted(pkg.glob("_C*.so")) + sorted(pkg.glob("_C*.pyd")):
        try:
            torch.ops.load_library(str(lib))
        except (OSError, RuntimeError):
            continue
        if _tv_op_exists():
            _REMEDY = "native"
            return _REMEDY
    # The compiled library does not load: give torchvision's fake-kernel registrations their operators.
    _TV_LIBRARY = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        _TV_LIBRARY.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _REMEDY = "stub"
    return _REMEDY


def import_open_clip() -> ModuleType:
    """``import open_clip`` after the torchvision remedy; use this instead of a bare import."""
    apply_torchvision_remedy()
    import open_clip

    return open_clip
