"""Checkpoints of a run: everything that persists across rounds, in one atomic safetensors file.

A checkpoint holds the round counter, the global parameters and the method's persistent state (``ctx.state``:
soft labels, server momentum, federated features, re-trained heads, ...). Random streams are counter-based
(``fedfeat.engine.rng``: a function of seed, round, epoch and sample), so nothing else is needed for a resumed run to
equal an uninterrupted one exactly. Scratch memory (``round_buffers``) is left out.

``ctx.state`` is a tree of dicts, lists, tensors and plain values; tensors go into the safetensors file under
their path (``state/agg/gW``), the tree's shape and plain values into its JSON metadata. Loading uses
safetensors (no pickle: a checkpoint cannot execute code).

Example::

    >>> save("ck.safetensors", 4, {"W": torch.zeros(2, 3)}, {"q": torch.ones(5, 2), "v": None})
    >>> rnd, glob, state = load("ck.safetensors", "cpu")
    >>> rnd, glob["W"].shape, state["v"]
    (4, torch.Size([2, 3]), None)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fedfeat.errors import FedfeatError

FORMAT = "fedfeat-checkpoint-1"
TRANSIENT = ("round_buffers",)  # scratch memory of the fused kernels: no state


def _pack(obj, path: str, tensors: dict):
    """The JSON skeleton of ``obj``; its tensors are put in ``tensors`` under their path."""
    if isinstance(obj, torch.Tensor):
        seen = tensors.setdefault("__seen__", {})  # one tensor held in two places is stored once
        if id(obj) not in seen:
            seen[id(obj)] = path
            tensors[path] = obj.detach().cpu().contiguous()
        return {"__tensor__": seen[id(obj)]}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"checkpoint: non-string key in {path}")
        return {"__dict__": {k: _pack(v, f"{path}/{k}", tensors) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_pack(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store {type(obj).__name__} at {path}")


def _unpack(obj, tensors: dict, device):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]].to(device)
        if "__dict__" in obj:
            return {k: _unpack(v, tensors, device) for k, v in obj["__dict__"].items()}
        if "__list__" in obj:
            return [_unpack(v, tensors, device) for v in obj["__list__"]]
    return obj


def save(path: str | Path, rnd: int, glob: dict, state: dict, extra: dict | None = None) -> None:
    """Write a checkpoint atomically: a temporary file, fsync, rename (a kill leaves the previous one)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict = {}
    skeleton = {
        "glob": _pack(glob, "glob", tensors),
        "state": _pack({k: v for k, v in state.items() if k not in TRANSIENT}, "state", tensors),
    }
    tensors.pop("__seen__", None)
    meta = {"format": FORMAT, "round": str(int(rnd)), "tree": json.dumps(skeleton), **(extra or {})}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_meta(path: str | Path) -> dict:
    """The checkpoint's metadata (``round``, ``format`` and what the run added) without loading tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise FedfeatError(
            f"checkpoint {path} is unreadable ({e}); start the run again with --overwrite"
        ) from None
    if meta.get("format") != FORMAT:
        raise FedfeatError(f"{path} is not a fedfeat checkpoint; start the run again with --overwrite")
    return meta


def load(path: str | Path, device) -> tuple[int, dict, dict]:
    """``(round, glob, state)`` from a checkpoint written by ``save``."""
    from safetensors.torch import load_file

    meta = read_meta(path)
    tensors = load_file(str(path))
    tree = json.loads(meta["tree"])
    return int(meta["round"]), _unpack(tree["glob"], tensors, device), _unpack(tree["state"], tensors, device)
