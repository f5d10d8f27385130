"""What every image reader shares: the ``ImageDataset`` interface, unreadable images, class-name cleaning and
content fingerprints of the files read (blake2b, cached by path, size and mtime).

The readers: ``fedfeat.data.files`` (CIFAR pickles, ImageFolder, list files) and ``fedfeat.data.hf`` (``hf:``,
``wds:``); ``fedfeat.data.open_dataset`` picks one by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.errors import FedfeatError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_SPLIT_ORDER = ("train", "val", "valid", "validation", "test")


class UnreadableImage(FedfeatError):
    """An image that cannot be decoded (or is missing); ``encode --skip-bad`` records it instead."""

    def __init__(self, where: str, reason: str):
        self.where = where
        super().__init__(
            f"cannot read image {where} ({reason}); fix or replace the file and re-run the same command "
            "(finished chunks are kept), or pass --skip-bad to skip it (its row gets label -1)"
        )


def clean_class_name(name: str) -> str:
    """``aquarium_fish`` -> ``aquarium fish`` (names come from the dataset's own metadata)."""
    return name.replace("_", " ").strip()


# ---------------------------------------------------------------------------------------- file fingerprint
HASH_BLOCK = 1 << 20  # bytes read per update while hashing a file
_RACY_NS = 2_000_000_000  # a file modified this recently may change again within its mtime tick: not cached


def hash_cache_dir() -> Path:
    """Where content hashes are cached: ``$FEDFEAT_CACHE_DIR`` or ``$XDG_CACHE_HOME/fedfeat`` (``~/.cache``)."""
    env = os.environ.get("FEDFEAT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedfeat"


def _hash_file(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class _HashCache:
    """Content hashes of one dataset root's files, cached by (name, size, mtime_ns) in a small JSON file.

    An entry is used only while the file's size and mtime are unchanged (and not for files modified in
    the last two seconds, whose mtime may not yet show a further edit). The file is written atomically
    (temporary file + rename); a cache that cannot be read or written is simply not used.
    """

    def __init__(self, root: Path):
        key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        self.path = hash_cache_dir() / "file-hashes" / f"{key}.json"
        self.root = root
        try:
            doc = json.loads(self.path.read_text())
            self.entries = doc["entries"] if doc.get("root") == str(root.resolve()) else {}
        except (OSError, ValueError, KeyError, TypeError):
            self.entries = {}
        self.dirty = False

    def digest(self, name: str) -> tuple[int, str]:
        """``(size, content hash)`` of ``root/name``; ``(-1, "missing")`` for a file that cannot be read."""
        path = self.root / name
        try:
            st = path.stat()
        except OSError:
            return -1, "missing"
        hit = self.entries.get(name)
        if isinstance(hit, list) and hit[:2] == [st.st_size, st.st_mtime_ns]:
            return st.st_size, hit[2]
        try:
            h = _hash_file(path)
        except OSError:
            return -1, "unreadable"
        if time.time_ns() - st.st_mtime_ns > _RACY_NS:
            self.entries[name] = [st.st_size, st.st_mtime_ns, h]
            self.dirty = True
        return st.st_size, h

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"root": str(self.root.resolve()), "entries": self.entries}))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home: hash again next time


def _files_fingerprint(files: list[tuple[str, int, str]]) -> dict:
    """Names (relative to the root), sizes and content hashes of the files read; listed (name -> size)
    for small datasets, hashed always."""
    h = hashlib.sha256()
    for name, size, digest in files:
        h.update(f"{name}\t{size}\t{digest}\n".encode())
    out: dict = {
        "count": len(files),
        "bytes": int(sum(max(s, 0) for _, s, _ in files)),
        "content": "blake2b-128",
        "sha256": h.hexdigest(),
    }
    if len(files) <= 32:
        out["files"] = {name: size for name, size, _ in files}
    return out


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return -1


# ---------------------------------------------------------------------------------------- base class
class ImageDataset:
    """A dataset on disk: named splits with ``[N]`` int64 labels, class names, and images by index.

    Subclasses fill ``class_names`` and ``_labels`` and implement ``load_image`` / ``item_name`` / ``files``.
    Images come back as RGB ``PIL.Image`` objects (decoded with PIL, never ``torchvision.io``).
    """

    format: str = ""
    layout: str = ""  # the expected layout on disk, quoted in error messages
    options: tuple[str, ...] = ()  # the ``open_dataset`` options (``domains``) the reader's constructor takes
    domain_names: list[str] | None = (
        None  # readers of multi-domain layouts: the domains, in their fixed order
    )

    def __init__(self, root: Path):
        self.root = root
        self.class_names: list[str] = []
        self._labels: dict[str, np.ndarray] = {}
        self._digests: list[tuple[str, int, str]] | None = None

    @property
    def split_names(self) -> list[str]:
        return list(self._labels)

    def n(self, split: str) -> int:
        return len(self.labels(split))

    def labels(self, split: str) -> np.ndarray:
        """``[N]`` int64 class ids of ``split``."""
        if split not in self._labels:
            raise FedfeatError(
                f"{self.format} at {self.root} has no split '{split}'; it has: {', '.join(self._labels)}"
            )
        return self._labels[split]

    def domains(self, split: str) -> np.ndarray | None:
        """``[N]`` int64 index into ``domain_names`` of every row of ``split``; None for single-domain readers."""
        self.labels(split)  # names an unknown split
        return None

    def load_image(self, split: str, i: int) -> Image.Image:
        """Image ``i`` of ``split`` as RGB; raises ``UnreadableImage`` when it cannot be decoded."""
        raise NotImplementedError

    def item_name(self, split: str, i: int) -> str:
        """Image ``i`` of ``split`` relative to the root: ``train/cat/1.png``, CIFAR ``data_batch_1[123]``."""
        raise NotImplementedError

    def describe(self, split: str, i: int) -> str:
        """Where image ``i`` of ``split`` lives, for messages: ``root / item_name``."""
        return str(self.root / self.item_name(split, i))

    def files(self) -> list[tuple[str, int]]:
        """``(name relative to root, size in bytes)`` of every file the dataset reads, sorted."""
        raise NotImplementedError

    def file_digests(self) -> list[tuple[str, int, str]]:
        """``(name, size, content hash)`` of every file the dataset reads, sorted; hashes are cached by
        (path, size, mtime) so a re-run does not read unchanged files again."""
        if self._digests is None:
            from concurrent.futures import ThreadPoolExecutor

            cache = _HashCache(self.root)
            names = [name for name, _ in self.files()]
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
                self._digests = [(name, *d) for name, d in zip(names, pool.map(cache.digest, names))]
            cache.save()
        return self._digests

    def fingerprint(self) -> dict:
        """What identifies the data: format, split sizes, class names and the files' names, sizes and
        contents."""
        out = {
            "format": self.format,
            "splits": {s: self.n(s) for s in self.split_names},
            "n_classes": len(self.class_names),
            "class_names": list(self.class_names),
            "files": _files_fingerprint(self.file_digests()),
        }
        out.update(self.fingerprint_extra())
        return out

    def fingerprint_extra(self) -> dict:
        """What else determines the rows beyond the files (multi-domain readers: the domains and the split
        rule); empty for single-domain readers, whose fingerprints are unchanged by it."""
        return {}

    def rows_of_files(self, names: set[str]) -> tuple[dict[str, np.ndarray], set[str]]:
        """Rows read from the files ``names``: ``({split: rows}, names that are not image sources)`` (for
        re-encoding only what a changed file feeds)."""
        raise NotImplementedError


def _split_key(name: str) -> tuple[int, str]:
    return (_SPLIT_ORDER.index(name) if name in _SPLIT_ORDER else len(_SPLIT_ORDER), name)


# ---------------------------------------------------------------------------------------- files on disk
class _FileDataset(ImageDataset):
    """Datasets whose images are files: ``self._paths[split]`` holds paths relative to the root."""

    def __init__(self, root: Path):
        super().__init__(root)
        self._paths: dict[str, list[str]] = {}
        self._extra_files: list[str] = []

    def _abs(self, split: str, i: int) -> Path:
        p = Path(self._paths[split][i])
        return p if p.is_absolute() else self.root / p

    def load_image(self, split: str, i: int) -> Image.Image:
        path = self._abs(split, i)
        try:
            with Image.open(path) as img:
                img.load()
                return img.convert("RGB")
        except FileNotFoundError:
            raise UnreadableImage(str(path), "file not found") from None
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise UnreadableImage(str(path), f"{type(e).__name__}: {e}") from None

    def item_name(self, split: str, i: int) -> str:
        return self._paths[split][i]

    def rows_of_files(self, names: set[str]) -> tuple[dict[str, np.ndarray], set[str]]:
        rows, used = {}, set()
        for split, paths in self._paths.items():
            hit = [i for i, p in enumerate(paths) if p in names]
            used.update(paths[i] for i in hit)
            if hit:
                rows[split] = np.asarray(hit, dtype=np.int64)
        return rows, set(names) - used

    def files(self) -> list[tuple[str, int]]:
        names = set(self._extra_files)
        for paths in self._paths.values():
            names.update(paths)
        return sorted((n, _size(self.root / n)) for n in names)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FedfeatError(f"cannot read {path} ({e}); expected a UTF-8 text file") from None
