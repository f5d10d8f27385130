"""Hugging Face ``datasets`` and webdataset tar shards as fedfeat image datasets (``hf:`` and ``wds:``).

``fedfeat.data.open_dataset`` opens ``hf:...`` with ``fedfeat.data.hf`` and ``wds:...`` with ``fedfeat.data.wds``;
this module holds what both share (the extra's check, image decoding, split names, the store's default name). Both readers are ``ImageDataset``\\ s with
random access by row, so ``encode``'s units of work (row-range chunks), crash-safe resume, fingerprint and
refresh rules apply unchanged. Both need the optional extra: ``pip install 'fedfeat[hf]'``.

``hf:NAME[:CONFIG]``
    ``NAME`` is a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (relative names
    resolve against ``--root``), read with ``datasets.load_from_disk``; otherwise a dataset in the local
    ``datasets`` cache (``HF_DATASETS_CACHE``), read with ``datasets.load_dataset(NAME, CONFIG)`` in offline mode
    (never a download). Image column: the one ``Image`` feature (else ``image`` / ``img``; or ``--image-column``);
    label column: the one ``ClassLabel`` feature (else ``label`` / ``fine_label``; or ``--label-column``); class
    names: the ``ClassLabel``'s names (or ``--classnames FILE``). Images are the stored bytes (or the file at the
    stored path), decoded with PIL. Fingerprint: the Arrow files (and any image files referenced by path).

``wds:PATTERN``
    webdataset tar shards: a brace pattern (``data/train-{000000..000001}.tar``), one ``.tar``, a folder of
    ``.tar`` shards, or a folder whose ``<split>/`` subfolders hold shards (CLIP_benchmark's ``wds_*`` layout:
    ``ROOT/{train,test}/{0..N-1}.tar`` listed by ``<split>/nshards.txt``, ``ROOT/classnames.txt``). Samples are
    grouped as webdataset groups tar members (``base_plus_ext``: ``s0000001.jpg`` + ``s0000001.cls``); the image
    is the first of ``webp``, ``png``, ``jpg``, ``jpeg`` present (CLIP_benchmark's order; or ``--image-column
    KEY``), the label the integer in ``cls`` (or ``--label-column KEY``). Class names: ``--classnames FILE``,
    else ``classnames.txt`` beside the shards or one folder up. Shards must be uncompressed tar files: each is
    indexed once (member offsets, cached in ``~/.cache/fedfeat/wds-index``), then images are read by offset.

Splits: the dataset's own names (a pattern's split is its shards' folder name, else the shards' leading word,
else ``train``); when there is no ``test`` split, ``validation`` (or ``valid``, ``val``) is stored as ``test``,
the split ``fedfeat train`` evaluates on. An ``hf:`` split whose labels are all ``-1`` (unlabelled, such as
ImageNet's test split) is left out.
"""

from __future__ import annotations

import importlib
import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.data.base import (
    UnreadableImage,
    _split_key,
)
from fedfeat.errors import FedfeatError

EXTRA = "pip install 'fedfeat[hf]'"
KNOWN_SPLITS = ("train", "val", "valid", "validation", "test")
EVAL_ALIASES = ("validation", "valid", "val")  # stored as "test" when the dataset has no test split
WDS_IMAGE_KEYS = ("webp", "png", "jpg", "jpeg")  # CLIP_benchmark's to_tuple order: the first present wins
WDS_LABEL_KEY = "cls"
NAME_FILES = ("classnames.txt", "class_names.txt")
_INDEX_VERSION = 1


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise FedfeatError(f"{what} need the '{module}' package: {EXTRA}") from None


def _decode(data: bytes, where: str) -> Image.Image:
    """Image bytes -> RGB ``PIL.Image`` exactly as the file readers decode a file."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UnreadableImage(where, f"{type(e).__name__}: {e}") from None


def _split_map(names: list[str]) -> dict[str, str]:
    """fedfeat split -> the source's split: the source's names, ``validation`` (``valid``, ``val``) as
    ``test`` when there is no ``test``; ordered train, val..., test, others."""
    out = {n: n for n in names}
    if "test" not in out:
        alias = next((a for a in EVAL_ALIASES if a in out), None)
        if alias is not None:
            out["test"] = out.pop(alias)
    return dict(sorted(out.items(), key=lambda kv: _split_key(kv[0])))


def _resolve(name: str, root: Path) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else root / p


def _rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when under it, else absolute (as a POSIX string)."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def _check_labels(y: np.ndarray, k: int, where: str, fix: str) -> None:
    if len(y) and (y.min() < 0 or y.max() >= k):
        bad = int(y[(y < 0) | (y >= k)][0])
        raise FedfeatError(f"{where} has label {bad} outside 0..{k - 1} ({k} class names); {fix}")


def default_store_name(spec: str, root: str | Path) -> str:
    """The store folder name ``encode`` uses: ``hf:uoft-cs/cifar10:plain`` -> ``cifar10-plain``; a saved
    directory or a ``wds:`` folder -> its name (the folder above ``train/``/``test/`` shard folders)."""
    root = Path(root).expanduser()
    kind, _, rest = spec.partition(":")
    if kind == "hf":
        name, _, config = rest.partition(":")
        p = _resolve(name, root)
        base = (p.resolve().name if p.is_dir() else name.rstrip("/").split("/")[-1]) or "hf"
        return f"{base}-{config}" if config else base
    p = _resolve(rest, root)
    try:
        braceexpand = importlib.import_module("braceexpand").braceexpand
        paths = [Path(x) for x in braceexpand(str(p))]
    except ImportError:
        paths = [p]
    d = p if len(paths) == 1 and p.is_dir() else Path(os.path.commonpath([str(x.parent) for x in paths]))
    d = d.resolve()
    if d.name in KNOWN_SPLITS and not any((d / s).is_dir() for s in KNOWN_SPLITS):
        d = d.parent
    return d.name or "wds"
