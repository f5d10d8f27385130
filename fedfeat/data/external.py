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
    label column: the one ``ClassLabel`` feature (else ``label`` / ``fine_label``, a plain integer column whose
    labels index ``--classnames FILE``'s names; or ``--label-column``); class names: the ``ClassLabel``'s names
    (or ``--classnames FILE``). A label outside the names is one line naming it and the file's count of names.
    Images are the stored bytes (or the file at the stored path), decoded with PIL. Fingerprint: the Arrow files
    (and any image files referenced by path).

``wds:PATTERN``
    webdataset tar shards: a brace pattern (``data/train-{000000..000001}.tar``), one ``.tar``, a folder of
    ``.tar`` shards, or a folder whose ``<split>/`` subfolders hold shards (CLIP_benchmark's ``wds_*`` layout:
    ``ROOT/{train,test}/{0..N-1}.tar`` listed by ``<split>/nshards.txt``, ``ROOT/classnames.txt``). ``N`` must
    match the folder's ``.tar`` files (checked before any name is made: a count that disagrees is one line naming
    the file and both numbers); a brace pattern may name at most ``MAX_PATTERN_SHARDS`` shards (checked on its
    text: ``braceexpand`` materialises ranges). Samples are grouped as webdataset groups tar members
    (``base_plus_ext``: ``s0000001.jpg`` + ``s0000001.cls``); the image is the first of ``webp``, ``png``,
    ``jpg``, ``jpeg`` present (CLIP_benchmark's order; or ``--image-column KEY``), the label the integer in
    ``cls`` (or ``--label-column KEY``; at most 64 bytes, an index into the class names). Class names: ``--classnames FILE``,
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
import re
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


def _check_labels(y: np.ndarray, k: int, where: str, fix: str, names_file: Path | None = None) -> None:
    """Integer labels index the ``k`` class names: one outside ``0..k-1`` is one line naming it (and the
    class-name file with its count of names, one per non-empty line, when the names come from a file)."""
    if len(y) and (y.min() < 0 or y.max() >= k):
        bad = int(y[(y < 0) | (y >= k)][0])
        if names_file is not None:
            raise FedfeatError(
                f"{where} has label {bad}, but the class-name file {names_file} has {k} names (one per non-empty "
                f"line), so labels must be in 0..{k - 1}; {fix}"
            )
        raise FedfeatError(f"{where} has label {bad} outside 0..{k - 1} ({k} class names); {fix}")


MAX_PATTERN_SHARDS = 100_000  # a brace pattern naming more is refused before it is expanded (LAION-400M: 41k)
_INT_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?")
_CHAR_RANGE = re.compile(r"[A-Za-z]\.\.[A-Za-z](?:\.\.-?\d+)?")


def pattern_count_bound(pattern: str) -> int:
    """An upper bound on how many names a brace pattern expands to, computed from its text (``braceexpand``
    materialises each range in full, so ``{0..999999999}`` would not return): the product over its brace groups
    of each group's count (a range's length, a list's items)."""
    total, stack, i = 1, [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append([i, 0])
        elif c == "," and stack:
            stack[-1][1] += 1
        elif c == "}" and stack:
            start, commas = stack.pop()
            inner = pattern[start + 1 : i]
            m = _INT_RANGE.fullmatch(inner)
            if m:
                step = abs(int(m.group(3) or 1)) or 1
                n = abs(int(m.group(2)) - int(m.group(1))) // step + 1
            elif _CHAR_RANGE.fullmatch(inner):
                n = 52
            else:
                n = commas + 1
            total *= n
        i += 1
    return total


def expand_pattern(pattern: str, braceexpand) -> list[str]:
    """``braceexpand(pattern)`` as a list, refused in one line when it would name more than
    ``MAX_PATTERN_SHARDS`` shards (checked on the pattern's text, before anything is expanded)."""
    n = pattern_count_bound(pattern)
    if n > MAX_PATTERN_SHARDS:
        shown = n if n < 10**15 else f"~10^{len(str(n)) - 1}"
        raise FedfeatError(
            f"wds: the pattern {pattern} names up to {shown} shards, more than {MAX_PATTERN_SHARDS}; check its "
            "ranges (or give the folder of shards)"
        )
    try:
        return list(braceexpand(pattern))
    except Exception as e:  # noqa: BLE001 - braceexpand's UnbalancedBracesError and the like
        raise FedfeatError(f"wds: cannot expand the pattern {pattern} ({e}); check its braces") from None


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
        paths = [Path(x) for x in expand_pattern(str(p), braceexpand)]
    except ImportError:
        paths = [p]
    d = p if len(paths) == 1 and p.is_dir() else Path(os.path.commonpath([str(x.parent) for x in paths]))
    d = d.resolve()
    if d.name in KNOWN_SPLITS and not any((d / s).is_dir() for s in KNOWN_SPLITS):
        d = d.parent
    return d.name or "wds"
