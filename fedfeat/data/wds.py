"""``wds:PATTERN``: webdataset tar shards (CLIP_benchmark's layout) as an ``ImageDataset``, members read by offset
from a cached index (the layouts and rules: ``fedfeat.data.external``).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.data.base import (
    _RACY_NS,
    ImageDataset,
    UnreadableImage,
    _size,
    hash_cache_dir,
)
from fedfeat.data.external import (
    _INDEX_VERSION,
    KNOWN_SPLITS,
    NAME_FILES,
    WDS_IMAGE_KEYS,
    WDS_LABEL_KEY,
    _check_labels,
    _decode,
    _rel,
    _require,
    _resolve,
    _split_map,
    expand_pattern,
)
from fedfeat.data.files import read_class_names
from fedfeat.errors import FedfeatError

# ---------------------------------------------------------------------------------------- webdataset
_NSHARDS_MAX_BYTES = 64  # nshards.txt holds one integer
MAX_LABEL_BYTES = 64  # a label member (.cls) holds one integer


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _dir_tars(d: Path) -> list[Path]:
    """A folder's ``*.tar`` regular files, in natural order (``2.tar`` before ``10.tar``)."""
    return sorted(
        (d / e.name for e in os.scandir(d) if e.is_file() and e.name.endswith(".tar")), key=_natural
    )


def _read_nshards(nfile: Path, present: int) -> int:
    """CLIP_benchmark's ``nshards.txt``: a decimal shard count. Read as a small regular file (never a FIFO or a
    huge file); not a plain non-negative integer is one line naming the file."""
    try:
        if not stat.S_ISREG(nfile.stat().st_mode):
            raise FedfeatError(f"wds: {nfile} is not a regular file; delete it (every *.tar is then used)")
        with open(nfile, "rb") as f:
            raw = f.read(_NSHARDS_MAX_BYTES + 1)
    except OSError as e:
        raise FedfeatError(f"wds: cannot read {nfile} ({e.strerror or e}); fix or delete it") from None
    text = raw.decode("utf-8", "replace").strip()
    if len(raw) > _NSHARDS_MAX_BYTES or not re.fullmatch(r"\d{1,18}", text):
        shown = text[:20] + ("..." if len(text) > 20 else "")
        raise FedfeatError(
            f"wds: {nfile} says {shown!r}, not a shard count (a plain integer; the folder holds {present} .tar "
            "files); fix or delete it (then every *.tar is used)"
        )
    return int(text)


def _dir_shards(d: Path) -> list[Path]:
    """A folder's shards: ``{0..N-1}.tar`` when it has CLIP_benchmark's ``nshards.txt``, else its ``*.tar`` in
    natural order (``2.tar`` before ``10.tar``).

    ``N`` is bounded by the shards present: it is checked against the folder's ``.tar`` files before any name is
    made, and a count that disagrees (more, or fewer, than the ``.tar`` files there, or ``{0..N-1}.tar`` not the
    files there) is one line naming the file and both numbers -- never a guess at which shards were meant."""
    tars = _dir_tars(d)
    nfile = d / "nshards.txt"
    if not (nfile.exists() or nfile.is_symlink()):
        return tars
    n = _read_nshards(nfile, len(tars))
    if n != len(tars):
        raise FedfeatError(
            f"wds: {nfile} says {n} shards but {d} holds {len(tars)} .tar files; copy the missing shards, or "
            f"fix nshards.txt (or delete it: then every *.tar is used)"
        )
    shards = [d / f"{i}.tar" for i in range(n)]
    names = {p.name for p in tars}
    missing = [s for s in shards if s.name not in names]
    if missing:
        raise FedfeatError(
            f"wds: {missing[0]} not found ({nfile} says {n} shards, named 0.tar..{n - 1}.tar; {d} holds {n} .tar "
            f"files, {len(missing)} of them named otherwise); rename the shards or delete nshards.txt"
        )
    return shards


def _shard_split(p: Path) -> str:
    if p.parent.name in KNOWN_SPLITS:
        return p.parent.name
    m = re.match(r"[A-Za-z]+", p.name)
    word = m.group(0).lower() if m else ""
    return word if word in KNOWN_SPLITS else "train"


class WebDataset(ImageDataset):
    """webdataset tar shards (see the module docstring); rows in shard order, then tar order."""

    format = "wds"
    layout = (
        "wds:PATTERN: uncompressed tar shards given by a brace pattern (data/train-{000000..000001}.tar), a folder "
        "of .tar shards, or a folder with <split>/ subfolders of shards (CLIP_benchmark: ROOT/train/{0..N-1}.tar, "
        "ROOT/test/..., <split>/nshards.txt, ROOT/classnames.txt); samples <key>.jpg|png|webp|jpeg + <key>.cls, "
        "class names in classnames.txt beside the shards (or one folder up) or --classnames FILE"
    )

    def __init__(
        self,
        spec: str,
        root: Path,
        image_column: str | None = None,
        label_column: str | None = None,
        classnames: Path | None = None,
    ):
        _require("webdataset", "wds: shards")
        self.label = f"wds:{spec}"
        if not spec:
            raise FedfeatError(
                "wds: needs shards: --dataset wds:PATTERN (e.g. wds:data/train-{000000..000001}.tar)"
            )
        by_split, base = self._shards(spec, root)
        super().__init__(base)
        self.image_keys = (image_column.lower(),) if image_column else WDS_IMAGE_KEYS
        self.label_key = (label_column or WDS_LABEL_KEY).lower()

        name_file = classnames
        if name_file is None:
            shard_dirs = list(dict.fromkeys(p.parent for ps in by_split.values() for p in ps))
            for d in [*shard_dirs, base, base.parent]:
                name_file = next((d / n for n in NAME_FILES if (d / n).is_file()), None)
                if name_file is not None:
                    break
        if name_file is None:
            raise FedfeatError(
                f"{self.label}: no classnames.txt beside the shards ({base}) or one folder up; give the class "
                "names with --classnames FILE (one per line, in label order)"
            )
        self.class_names = read_class_names(name_file)
        self._names_file = name_file

        self._shard_paths: list[Path] = []
        self._rows: dict[str, np.ndarray] = {}  # split -> [N, 3] int64: shard index, offset, size
        self._keys: dict[str, list[str]] = {}  # split -> "<key>.<ext>" of each row's image member
        self.split_sources: dict[str, str] = {}
        for split, src in _split_map(list(by_split)).items():
            self.split_sources[split] = src
            rows, keys, labels = [], [], []
            for path in by_split[src]:
                si = len(self._shard_paths)
                self._shard_paths.append(path)
                idx = self._index(path)
                if not len(idx["offset"]):
                    continue
                rows.append(np.stack([np.full(len(idx["offset"]), si), idx["offset"], idx["size"]], axis=1))
                keys += [
                    f"{k}.{self.image_keys[e]}" for k, e in zip(idx["key"].tolist(), idx["ext"].tolist())
                ]
                y = idx["label"]
                _check_labels(
                    y,
                    len(self.class_names),
                    f"wds: shard {path} ('{self.label_key}')",
                    f"fix the shard's '{self.label_key}' entries or the class names",
                    names_file=name_file,
                )
                labels.append(y)
            if not rows:
                raise FedfeatError(
                    f"wds: the shards of split '{src}' hold no samples; expected {self.layout}"
                )
            self._rows[split] = np.concatenate(rows).astype(np.int64)
            self._keys[split] = keys
            self._labels[split] = np.concatenate(labels).astype(np.int64)
        self._shard_names = [_rel(p, self.root) for p in self._shard_paths]
        self._fds: dict[int, int] = {}

    # ------------------------------------------------------------------ shards and index
    def _shards(self, spec: str, root: Path) -> tuple[dict[str, list[Path]], Path]:
        p = _resolve(spec, root)
        if "{" not in spec and p.is_dir():
            direct = _dir_shards(p)
            if direct:
                return {p.name if p.name in KNOWN_SPLITS else "train": direct}, p
            subs = {
                e.name: _dir_shards(p / e.name)
                for e in sorted(os.scandir(p), key=lambda e: e.name)
                if e.is_dir() and not e.name.startswith(".")
            }
            subs = {k: v for k, v in subs.items() if v}
            if not subs:
                raise FedfeatError(f"wds: no .tar shards in {p} or its subfolders; expected {self.layout}")
            return subs, p
        from braceexpand import braceexpand

        expanded = [Path(x) for x in expand_pattern(str(p), braceexpand)]
        missing = [x for x in expanded if not x.is_file()]
        if missing:
            raise FedfeatError(
                f"wds: shard {missing[0]} not found ({len(missing)} of {len(expanded)} missing); check the "
                "pattern (quote it, 'wds:dir/{0..9}.tar', so that the shell leaves the braces to fedfeat)"
            )
        if len({x.resolve() for x in expanded}) != len(expanded):
            raise FedfeatError(f"wds: the pattern {spec} names a shard twice; list each shard once")
        by_split: dict[str, list[Path]] = {}
        for x in expanded:
            by_split.setdefault(_shard_split(x), []).append(x)
        return by_split, Path(os.path.commonpath([str(x.parent) for x in expanded]))

    def _index(self, path: Path) -> dict[str, np.ndarray]:
        """The shard's samples (``key``, image ``ext`` index, member ``offset`` and ``size``, ``label``), read
        from the index cache when the shard's size and mtime are unchanged, else built and cached."""
        st = path.stat()
        ident = f"{_INDEX_VERSION}\t{path.resolve()}\t{','.join(self.image_keys)}\t{self.label_key}"
        cache = hash_cache_dir() / "wds-index" / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".npz")
        stamp = np.asarray([st.st_size, st.st_mtime_ns], dtype=np.int64)
        try:
            with np.load(cache, allow_pickle=False) as z:
                if np.array_equal(z["stamp"], stamp):
                    return {k: z[k] for k in ("key", "ext", "offset", "size", "label")}
        except (OSError, ValueError, KeyError):
            pass
        idx = self._build_index(path)
        if time.time_ns() - st.st_mtime_ns > _RACY_NS:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_name(f".{cache.stem}.{os.getpid()}.tmp.npz")
                np.savez(tmp, stamp=stamp, **idx)
                os.replace(tmp, cache)
            except OSError:
                pass  # a read-only home: index again next time
        return idx

    def _build_index(self, path: Path) -> dict[str, np.ndarray]:
        from webdataset.tariterators import base_plus_ext, meta_prefix, meta_suffix

        groups: list[tuple[str, dict[str, tuple[int, int]]]] = []
        try:
            with tarfile.open(path, "r:") as tf:
                for ti in tf:
                    name = ti.name
                    if not ti.isreg() or name is None:
                        continue
                    if "/" not in name and name.startswith(meta_prefix) and name.endswith(meta_suffix):
                        continue
                    if re.match(r"__[^/]*__($|/)", name):  # webdataset's skip_meta
                        continue
                    key, ext = base_plus_ext(name)
                    if key is None:
                        continue
                    ext = ext.lower()
                    if not groups or groups[-1][0] != key:
                        groups.append((key, {}))
                    if ext in groups[-1][1]:
                        raise FedfeatError(
                            f"wds: {path} has '{name}' twice in sample '{key}'; rewrite the shard"
                        )
                    groups[-1][1][ext] = (ti.offset_data, ti.size)
                    tf.members = []  # keep memory flat on big shards
        except (tarfile.TarError, OSError, EOFError) as e:
            raise FedfeatError(
                f"wds: {path} is not a readable uncompressed tar file ({type(e).__name__}: {e}); random access "
                "needs plain .tar shards (decompress .tar.gz ones)"
            ) from None
        n = len(groups)
        out = {
            "key": np.asarray([k for k, _ in groups], dtype=np.str_) if n else np.zeros(0, dtype="<U1"),
            "ext": np.zeros(n, dtype=np.int8),
            "offset": np.zeros(n, dtype=np.int64),
            "size": np.zeros(n, dtype=np.int64),
            "label": np.zeros(n, dtype=np.int64),
        }
        with open(path, "rb") as f:
            fd = f.fileno()
            for j, (key, members) in enumerate(groups):
                e = next((k for k, ext in enumerate(self.image_keys) if ext in members), None)
                if e is None or self.label_key not in members:
                    what = (
                        f"no image ({'/'.join(self.image_keys)})" if e is None else f"no '{self.label_key}'"
                    )
                    raise FedfeatError(
                        f"wds: sample '{key}' in {path} has {what} (it has: {', '.join(members)}); every sample "
                        "needs an image and a label (--image-column / --label-column name other keys)"
                    )
                off, size = members[self.label_key]
                raw = os.pread(fd, min(size, MAX_LABEL_BYTES + 1), off)
                try:
                    if size > MAX_LABEL_BYTES:
                        raise ValueError(f"{size} bytes")
                    out["label"][j] = int(raw.decode("utf-8").strip())
                except (UnicodeDecodeError, ValueError, OverflowError):
                    raise FedfeatError(
                        f"wds: sample '{key}' in {path}: '{self.label_key}' is {raw[:20]!r}, not an integer label; "
                        "fix the shard or name the label key with --label-column"
                    ) from None
                out["ext"][j] = e
                out["offset"][j], out["size"][j] = members[self.image_keys[e]]
        return out

    # ------------------------------------------------------------------ ImageDataset
    def _fd(self, si: int) -> int:
        fd = self._fds.get(si)
        if fd is None:
            if len(self._fds) >= 64:  # rows are read shard by shard: a few open files suffice
                self.close()
            fd = self._fds[si] = os.open(self._shard_paths[si], os.O_RDONLY)
        return fd

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __getstate__(self):  # DataLoader workers under spawn: reopen files there
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def load_image(self, split: str, i: int) -> Image.Image:
        si, off, size = (int(v) for v in self._rows[split][int(i)])
        try:
            data = os.pread(self._fd(si), size, off)
        except OSError as e:
            raise UnreadableImage(self.describe(split, i), f"{type(e).__name__}: {e}") from None
        if len(data) != size:
            raise UnreadableImage(self.describe(split, i), f"the shard ends {size - len(data)} bytes early")
        return _decode(data, self.describe(split, i))

    def item_name(self, split: str, i: int) -> str:
        return f"{self._shard_names[int(self._rows[split][int(i), 0])]}[{self._keys[split][int(i)]}]"

    def files(self) -> list[tuple[str, int]]:
        out = {name: _size(p) for name, p in zip(self._shard_names, self._shard_paths)}
        names_rel = _rel(self._names_file, self.root)
        if not Path(names_rel).is_absolute():  # a names file outside the root: its names are fingerprinted
            out[names_rel] = _size(self._names_file)
        return sorted(out.items())

    def fingerprint(self) -> dict:
        fp = super().fingerprint()
        fp["source"] = {
            "image_keys": list(self.image_keys),
            "label_key": self.label_key,
            "splits": dict(self.split_sources),
        }
        return fp

    def rows_of_files(self, names: set[str]) -> tuple[dict[str, np.ndarray], set[str]]:
        hit = {k for k, n in enumerate(self._shard_names) if n in names}
        rows = {
            s: np.flatnonzero(np.isin(r[:, 0], list(hit))).astype(np.int64) for s, r in self._rows.items()
        }
        used = {self._shard_names[k] for k in hit}
        return {s: r for s, r in rows.items() if len(r)}, set(names) - used
