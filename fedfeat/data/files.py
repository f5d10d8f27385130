"""Image datasets read from disk in their published formats (fedfeat never downloads data).

Formats (``fedfeat.data.open_dataset(name, root)``; ``hf:`` and ``wds:`` in ``fedfeat.data.hf``):

==================  ==============================================================================================
``cifar10``         the CIFAR-10 "python version" folder ``cifar-10-batches-py/``: ``data_batch_1`` ... ``_5``
                    (split ``train``), ``test_batch`` (``test``), class names from ``batches.meta``
``cifar100``        the CIFAR-100 "python version" folder ``cifar-100-python/``: ``train``, ``test``; fine labels,
                    class names from ``meta`` (``fine_label_names``)
``cinic10``         CINIC-10: ImageFolder trees ``train/``, ``valid/``, ``test/`` with one folder per class
``imagefolder``     any ``root/<split>/<class>/<image>`` tree (the class set is the union over the splits)
``listfile``        ``<split>.txt`` (or ``<prefix>_<split>.txt`` such as ``ImageNet_LT_train.txt``) files of
                    ``relative/path label`` lines, images resolved against ``root``, plus ``classnames.txt``
                    (or ``class_names.txt``): one class name per line in label order; a leading label number or
                    WordNet id (``n01440764 tench``) on every line is dropped
``coop``            CoOp / Dassl few-shot benchmarks: ``split_zhou_<Name>.json`` (train / val / test lists of
                    ``[path, label, classname]``) beside the dataset's image folder (``fedfeat.data.domains``)
``domainnet``       DomainNet: ``<domain>/<class>/<image>`` with ``<domain>_train.txt`` / ``<domain>_test.txt``
                    lists, every domain's rows (or ``--domains``) in one store, each row's domain recorded
``domainfolder``    ``<domain>/<class>/<image>`` trees split per domain as FedCLIP does (train / val / test);
                    presets ``pacs``, ``officehome``, ``vlcs``, ``office-caltech10`` (``fedfeat.data.domains``)
``hf:NAME``         a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` or in the local cache, and
``wds:PATTERN``     webdataset tar shards: ``fedfeat.data.hf`` (the optional extra ``fedfeat[hf]``)
==================  ==============================================================================================

Class names have ``_`` replaced by a space. CIFAR pickles are read by a restricted unpickler that only admits
what those files contain (dicts, lists, strings and numpy arrays): a data file never runs code.

Example::

    >>> from fedfeat.data import open_dataset
    >>> ds = open_dataset("cifar10", "~/data/cifar-10-batches-py")
    >>> ds.split_names, ds.n("train"), ds.class_names[:2]
    (['train', 'test'], 50000, ['airplane', 'automobile'])
    >>> ds.load_image("train", 0).size
    (32, 32)
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.data.base import (
    _SPLIT_ORDER,
    IMG_EXTENSIONS,
    ImageDataset,
    _FileDataset,
    _read_text,
    _size,
    _split_key,
    clean_class_name,
)
from fedfeat.errors import FedfeatError


# ------------------------------------------------------------------------------------ restricted unpickling
def _np_global(*candidates: tuple[str, str]):
    import importlib

    for mod, name in candidates:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    return None


# Exactly the globals that CIFAR "python version" pickles (and numpy arrays pickled by Python 3) refer to.
_RECONSTRUCT = _np_global(
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct")
)
_FROMBUFFER = _np_global(("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"))
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only numpy array reconstruction; any other global (``os.system``, ...) is refused."""

    def find_class(self, module: str, name: str):
        fn = _ALLOWED_GLOBALS.get((module, name))
        if fn is None:
            raise pickle.UnpicklingError(f"refusing global {module}.{name}")
        return fn


def restricted_load(path: Path) -> object:
    """Unpickle a CIFAR batch file without letting it run code (Python 2 strings come back as ``bytes``).

    Raises ``FedfeatError`` naming the file when it is unreadable or refers to anything but numpy arrays.
    """
    try:
        with open(path, "rb") as f:
            return _RestrictedUnpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        OSError,
    ) as e:
        raise FedfeatError(
            f"{path} is not a readable CIFAR pickle ({type(e).__name__}: {e}); re-extract the dataset archive"
        ) from None


def _key(d: dict, name: str):
    """``d[b'name']`` or ``d['name']`` (Python 2 pickles have bytes keys)."""
    if name.encode() in d:
        return d[name.encode()]
    return d.get(name)


def _to_str(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


# ---------------------------------------------------------------------------------------- CIFAR
class _CifarBase(ImageDataset):
    folder = ""
    split_files: dict[str, tuple[str, ...]] = {}
    meta_file = ""
    names_key = ""
    labels_key = ""
    layout = ""

    def __init__(self, root: Path):
        super().__init__(self._find_root(root))
        meta = self._read(self.meta_file)
        names = _key(meta, self.names_key) if isinstance(meta, dict) else None
        if not isinstance(names, list) or not names:
            raise FedfeatError(
                f"{self.root / self.meta_file} has no '{self.names_key}' list; expected {self.layout}"
            )
        self.class_names = [clean_class_name(_to_str(x)) for x in names]
        self._images: dict[str, np.ndarray] = {}  # split -> [N, 32, 32, 3] uint8
        self._rows: dict[str, list[tuple[str, int]]] = {}  # split -> per-file (name, rows)
        for split, fnames in self.split_files.items():
            data, labels, rows = [], [], []
            for fn in fnames:
                d = self._read(fn)
                x = _key(d, "data") if isinstance(d, dict) else None
                y = _key(d, self.labels_key) if isinstance(d, dict) else None
                if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != 3072 or x.dtype != np.uint8:
                    raise FedfeatError(
                        f"{self.root / fn} has no 'data' array of shape [N, 3072] uint8; "
                        f"expected {self.layout}"
                    )
                y = np.asarray(y if y is not None else [], dtype=np.int64)
                if y.shape != (len(x),):
                    raise FedfeatError(
                        f"{self.root / fn} has {len(y)} '{self.labels_key}' for {len(x)} images; "
                        f"expected {self.layout}"
                    )
                if len(y) and (y.min() < 0 or y.max() >= len(self.class_names)):
                    raise FedfeatError(
                        f"{self.root / fn} has labels outside 0..{len(self.class_names) - 1}; "
                        f"expected {self.layout}"
                    )
                data.append(x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
                labels.append(y)
                rows.append((fn, len(x)))
            self._images[split] = np.ascontiguousarray(np.concatenate(data))
            self._labels[split] = np.concatenate(labels)
            self._rows[split] = rows

    def _find_root(self, root: Path) -> Path:
        if not (root / self.meta_file).is_file() and (root / self.folder / self.meta_file).is_file():
            return root / self.folder
        if not root.is_dir():
            raise FedfeatError(f"{self.format}: {root} is not a directory; expected {self.layout}")
        return root

    def _read(self, fn: str):
        path = self.root / fn
        if not path.is_file():
            raise FedfeatError(f"{self.format}: {path} not found; expected {self.layout}")
        return restricted_load(path)

    def load_image(self, split: str, i: int) -> Image.Image:
        return Image.fromarray(self._images[split][i])  # [32, 32, 3] uint8 -> RGB

    def item_name(self, split: str, i: int) -> str:
        for fn, n in self._rows[split]:
            if i < n:
                return f"{fn}[{i}]"
            i -= n
        raise IndexError(i)

    def files(self) -> list[tuple[str, int]]:
        names = [self.meta_file] + [fn for fns in self.split_files.values() for fn in fns]
        return sorted((fn, _size(self.root / fn)) for fn in names)

    def rows_of_files(self, names: set[str]) -> tuple[dict[str, np.ndarray], set[str]]:
        rows: dict[str, np.ndarray] = {}
        used = set()
        for split, per_file in self._rows.items():
            start, hit = 0, []
            for fn, n in per_file:
                if fn in names:
                    hit.append(np.arange(start, start + n))
                    used.add(fn)
                start += n
            if hit:
                rows[split] = np.concatenate(hit)
        return rows, set(names) - used


class Cifar10(_CifarBase):
    format = "cifar10"
    folder = "cifar-10-batches-py"
    split_files = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
    meta_file = "batches.meta"
    names_key = "label_names"
    labels_key = "labels"
    layout = (
        "the CIFAR-10 python version folder cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta)"
    )


class Cifar100(_CifarBase):
    format = "cifar100"
    folder = "cifar-100-python"
    split_files = {"train": ("train",), "test": ("test",)}
    meta_file = "meta"
    names_key = "fine_label_names"
    labels_key = "fine_labels"
    layout = "the CIFAR-100 python version folder cifar-100-python/ (train, test, meta)"


def _list_images(d: Path) -> list[str]:
    return sorted(
        e.name
        for e in os.scandir(d)
        if e.is_file() and not e.name.startswith(".") and e.name.lower().endswith(IMG_EXTENSIONS)
    )


class ImageFolder(_FileDataset):
    """``root/<split>/<class>/<image>``; class ids index the sorted union of class folder names."""

    format = "imagefolder"
    required_splits: tuple[str, ...] = ()
    layout = "root/<split>/<class>/<image> (e.g. train/cat/0001.png), images with extensions " + " ".join(
        IMG_EXTENSIONS
    )

    def __init__(self, root: Path):
        super().__init__(root)
        if not root.is_dir():
            raise FedfeatError(f"{self.format}: {root} is not a directory; expected {self.layout}")
        for s in self.required_splits:
            if not (root / s).is_dir():
                raise FedfeatError(f"{self.format}: {root / s} not found; expected {self.layout}")
        split_dirs = sorted(
            (e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")), key=_split_key
        )
        if self.required_splits:
            split_dirs = [s for s in split_dirs if s in self.required_splits]
        class_dirs = {
            s: sorted(e.name for e in os.scandir(root / s) if e.is_dir() and not e.name.startswith("."))
            for s in split_dirs
        }
        class_dirs = {s: c for s, c in class_dirs.items() if c}
        if not class_dirs:
            raise FedfeatError(
                f"{self.format}: no <split>/<class>/ folders under {root}; expected {self.layout}"
            )
        raw = sorted(set().union(*class_dirs.values()))
        index = {c: k for k, c in enumerate(raw)}
        self.class_names = [clean_class_name(c) for c in raw]
        for split, classes in class_dirs.items():
            paths, labels = [], []
            for c in classes:
                for fn in _list_images(root / split / c):
                    paths.append(f"{split}/{c}/{fn}")
                    labels.append(index[c])
            if not paths:
                raise FedfeatError(f"{self.format}: no images under {root / split}; expected {self.layout}")
            self._paths[split] = paths
            self._labels[split] = np.asarray(labels, dtype=np.int64)


class Cinic10(ImageFolder):
    format = "cinic10"
    required_splits = ("train", "valid", "test")
    layout = "the CINIC-10 folder with train/, valid/, test/, each holding one folder per class of PNGs"


def _list_split_name(stem: str) -> str:
    """``train`` from ``train``, ``ImageNet_LT_train`` or ``train_list``: the last ``_``-part that is a known
    split name, else the last ``_``-part (``ImageNet_LT_open`` -> ``open``)."""
    parts = stem.lower().split("_")
    known = [x for x in parts if x in _SPLIT_ORDER]
    return known[-1] if known else parts[-1]


def read_class_names(path: Path) -> list[str]:
    """Class names from a text file, one per line in label order (``_`` -> space); a leading label number
    (``0 tench``, any order) or WordNet id (``n01440764 tench``) on every line is dropped."""
    lines = [ln.strip() for ln in _read_text(path).splitlines() if ln.strip()]
    if not lines:
        raise FedfeatError(f"{path} is empty; expected one class name per line")
    parts = [ln.split(None, 1) for ln in lines]
    if all(len(p) == 2 and p[0].isdigit() for p in parts):  # "0 tench": label number first
        ids = [int(p[0]) for p in parts]
        if sorted(ids) != list(range(len(ids))):
            raise FedfeatError(f"{path}: the leading label numbers are not 0..{len(ids) - 1}; fix the file")
        names = [""] * len(ids)
        for k, p in zip(ids, parts):
            names[k] = p[1]
        lines = names
    elif all(len(p) == 2 and re.fullmatch(r"n\d{8}", p[0]) for p in parts):  # "n01440764 tench"
        lines = [p[1] for p in parts]
    return [clean_class_name(n) for n in lines]


class ListFile(_FileDataset):
    """``<split>.txt`` lists of ``path label`` lines and a class-name file (ImageNet-LT, CPL/CoOp bundles)."""

    format = "listfile"
    name_files = ("classnames.txt", "class_names.txt")
    layout = (
        "root/<split>.txt (or <prefix>_<split>.txt, <split>_list.txt) with 'relative/path label' lines, "
        "images relative to root, "
        "and root/classnames.txt with one class name per line in label order"
    )

    def __init__(self, root: Path):
        super().__init__(root)
        if not root.is_dir():
            raise FedfeatError(f"{self.format}: {root} is not a directory; expected {self.layout}")
        name_file = next((root / n for n in self.name_files if (root / n).is_file()), None)
        if name_file is None:
            raise FedfeatError(
                f"{self.format}: {root / self.name_files[0]} not found; expected {self.layout}"
            )
        self.class_names = self._read_names(name_file)
        self._extra_files.append(name_file.name)
        lists = sorted(p for p in root.glob("*.txt") if p.name not in self.name_files)
        by_split: dict[str, Path] = {}
        for p in lists:
            split = _list_split_name(p.stem)
            if split in by_split:
                raise FedfeatError(
                    f"{self.format}: {by_split[split].name} and {p.name} both give split '{split}'; "
                    "keep one list file per split"
                )
            by_split[split] = p
        if not by_split:
            raise FedfeatError(f"{self.format}: no <split>.txt list files in {root}; expected {self.layout}")
        for split in sorted(by_split, key=_split_key):
            self._read_list(split, by_split[split])

    def _read_names(self, path: Path) -> list[str]:
        return read_class_names(path)

    def _text(self, path: Path) -> str:
        return _read_text(path)

    def _read_list(self, split: str, path: Path) -> None:
        paths, labels = [], []
        for i, line in enumerate(self._text(path).splitlines()):
            if not line.strip():
                continue
            parts = line.strip().rsplit(None, 1)
            if len(parts) != 2 or not re.fullmatch(r"-?\d+", parts[1]):
                raise FedfeatError(f"{path}:{i + 1}: expected 'relative/path label', got {line.strip()!r}")
            y = int(parts[1])
            if not 0 <= y < len(self.class_names):
                raise FedfeatError(
                    f"{path}:{i + 1}: label {y} is outside 0..{len(self.class_names) - 1} "
                    f"({len(self.class_names)} names in the class-name file); fix the list or the names"
                )
            paths.append(parts[0])
            labels.append(y)
        if not paths:
            raise FedfeatError(f"{path} lists no images; expected {self.layout}")
        self._paths[split] = paths
        self._labels[split] = np.asarray(labels, dtype=np.int64)
        self._extra_files.append(path.name)


DATASETS: dict[str, type[ImageDataset]] = {
    "cifar10": Cifar10,
    "cifar100": Cifar100,
    "cinic10": Cinic10,
    "imagefolder": ImageFolder,
    "listfile": ListFile,
}

from fedfeat.data.domains import DOMAIN_DATASETS  # noqa: E402  (domains.py imports only base.py)

DATASETS.update(DOMAIN_DATASETS)
