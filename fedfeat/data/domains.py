"""Readers of published multi-domain and few-shot-benchmark layouts, each row's domain recorded.

======================  ======================================================================================
``coop``                CoOp / Dassl: ``root/split_zhou_<Name>.json`` (keys ``train``, ``val``, ``test``: lists of
                        ``[relative image path, label, classname]``) and the dataset's image folder; a path is
                        joined to the image folder as Dassl's ``read_split`` does (``SPLIT_FILES``: ``images/``
                        for OxfordPets, ``101_ObjectCategories/`` for Caltech101, ``jpg/`` for OxfordFlowers,
                        the dataset folder itself for StanfordCars ...; for another split file name, the folder
                        holding the first listed image); ``root`` may also be CoOp's data folder holding one
                        such dataset folder (``oxford_pets/``). Class names: the JSON's classname per label.
``domainnet``           DomainNet: ``root/<domain>/<class>/<image>`` with list files ``<domain>_train.txt`` /
                        ``<domain>_test.txt`` of ``<domain>/<class>/<file> <label>`` lines; splits ``train``
                        and ``test`` concatenate the domains in alphabetical order (the six published ones:
                        clipart, infograph, painting, quickdraw, real, sketch); class names are the class
                        folders of the list lines, in label order.
``domainfolder``        ``root/<domain>/<class>/<image>`` trees, domains in alphabetical order. Each domain is
                        read as torchvision's ``ImageFolder`` reads it and split as FedCLIP splits it
                        (``fedclip_split``): splits ``train`` / ``val`` / ``test`` (60 / 20 / 20 %) and
                        ``rest`` (the 0-2 rows per domain that FedCLIP's rounding leaves out, kept so that a
                        held-out domain can be tested whole), each the domains concatenated in order. Classes:
                        the sorted union of the class folders.
``pacs``                ``domainfolder`` with the published domain folders in the published order (``PRESETS``):
``officehome``          art_painting, cartoon, photo, sketch; Art, Clipart, Product, Real_World (or
``vlcs``                ``Real World``); Caltech101, LabelMe, SUN09, VOC2007; amazon, caltech, dslr, webcam
``office-caltech10``
======================  ======================================================================================

``domainnet``, ``domainfolder`` and the presets take the option ``domains`` (``encode --domains clipart,sketch``):
a subset of the domains, kept in the reader's order. Every reader here has ``domain_names`` and ``domains(split)``
(``[N]`` int64 index into ``domain_names`` per row; ``coop`` is one domain: None), which ``encode`` records in the
store (``FeatureStore.domains``).

References transcribed (read at the commits named):

- CoOp, ``KaiyangZhou/CoOp`` @ ff61507c790454bce7c5052c3ac39e60772f1f89: ``datasets/oxford_pets.py:123-138``
  (``read_split``: ``os.path.join(image_dir, impath)``, ``int(label)``, classname kept), and per dataset the
  ``image_dir`` / ``split_path`` lines (``caltech101.py:27-28``, ``oxford_pets.py:19-21``,
  ``oxford_flowers.py:21,24``, ``stanford_cars.py:19,24`` (prefix: the dataset folder), ``dtd.py:19-20``,
  ``eurosat.py:32-33``, ``food101.py:19-20``, ``sun397.py:18-19``, ``ucf101.py:19-20``). ImageNet and
  FGVCAircraft, the other two of CoOp's 11, have no ``split_zhou`` file (read them with ``imagefolder`` /
  ``listfile``).
- FedCLIP, ``microsoft/PersonalizedFL`` @ 441670edb5744d23af46867cce9a5fbec0f8ead3:
  ``fedclip/utils/prepare_data_dg_clip.py:22-23`` (one ``torchvision.datasets.ImageFolder`` per domain folder) and
  ``:82-89`` (``index = np.arange(l); np.random.seed(args.seed); np.random.shuffle(index)``; ``l1, l2, l3 =
  int(l*args.datapercent), int(l*0.2), int(l*0.2)``; train ``index[:l1]``, val ``index[l1:l1+l2]``, test
  ``index[l1+l2:l1+l2+l3]``), with ``fedclip/methods/fed_at_clip.py``'s defaults ``--seed 0``, ``--datapercent
  0.6``; PACS's domain order from ``fedclip/utils/config.py:12``. FedCLIP tests its ``--test_envs`` domain on all
  of its images: here the union of that domain's rows of every split.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from fedfeat.data.base import IMG_EXTENSIONS, _FileDataset, _read_text, clean_class_name
from fedfeat.errors import FedfeatError

# CoOp's datasets with a split_zhou file: split file name -> (CoOp's dataset folder, image folder inside it)
SPLIT_FILES: dict[str, tuple[str, str]] = {
    "split_zhou_OxfordPets.json": ("oxford_pets", "images"),
    "split_zhou_Caltech101.json": ("caltech-101", "101_ObjectCategories"),
    "split_zhou_OxfordFlowers.json": ("oxford_flowers", "jpg"),
    "split_zhou_StanfordCars.json": ("stanford_cars", ""),
    "split_zhou_DescribableTextures.json": ("dtd", "images"),
    "split_zhou_EuroSAT.json": ("eurosat", "2750"),
    "split_zhou_Food101.json": ("food-101", "images"),
    "split_zhou_SUN397.json": ("sun397", "SUN397"),
    "split_zhou_UCF101.json": ("ucf101", "UCF-101-midframes"),
}

# FedCLIP's split (prepare_data_dg_clip.py:82-89 and fed_at_clip.py's defaults)
FEDCLIP_SEED = 0
FEDCLIP_FRACTIONS = (0.6, 0.2, 0.2)  # --datapercent, then 0.2 and 0.2


def fedclip_split(n: int, seed: int = FEDCLIP_SEED) -> dict[str, np.ndarray]:
    """FedCLIP's split of one domain's ``n`` ImageFolder samples: ``{"train", "val", "test", "rest"}`` -> indices.

    Bit-identical to ``np.random.seed(seed); np.random.shuffle(index)`` with ``index = np.arange(n)`` (the same
    MT19937 stream, without touching numpy's global state), then ``int(n * 0.6)``, ``int(n * 0.2)``, ``int(n *
    0.2)`` rows; ``rest`` holds what those roundings leave out (FedCLIP uses none of it).
    """
    index = np.arange(n)
    np.random.RandomState(seed).shuffle(index)
    l1, l2, l3 = (int(n * f) for f in FEDCLIP_FRACTIONS)
    return {
        "train": index[:l1],
        "val": index[l1 : l1 + l2],
        "test": index[l1 + l2 : l1 + l2 + l3],
        "rest": index[l1 + l2 + l3 :],
    }


def torchvision_imagefolder(d: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """``(classes, [(path relative to d, class index)])`` in the order ``torchvision.datasets.ImageFolder(d)``
    lists them: classes sorted, then per class ``sorted(os.walk(class_dir, followlinks=True))`` and sorted file
    names with an image extension (case-insensitive). Hidden (``.``) folders are not classes here."""
    classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))
    samples = []
    for k, c in enumerate(classes):
        for dirpath, _, fnames in sorted(os.walk(d / c, followlinks=True)):
            for fn in sorted(fnames):
                if fn.lower().endswith(IMG_EXTENSIONS):
                    samples.append((Path(dirpath, fn).relative_to(d).as_posix(), k))
    return classes, samples


def _domain_option(fmt: str, domains) -> list[str] | None:
    if domains is None:
        return None
    items = [domains] if isinstance(domains, str) else list(domains)
    out = [d.strip() for x in items for d in str(x).split(",") if d.strip()]
    if not out:
        raise FedfeatError(f"{fmt}: --domains is empty; give domain names, e.g. --domains clipart,sketch")
    return list(dict.fromkeys(out))


class _DomainDataset(_FileDataset):
    """Image files with a domain per row: ``domain_names`` and ``_domains[split]`` ([N] int64)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.domain_names: list[str] | None = None
        self._domains: dict[str, np.ndarray] = {}

    def domains(self, split: str) -> np.ndarray | None:
        self.labels(split)
        return self._domains.get(split)

    def fingerprint_extra(self) -> dict:
        return {"domain_names": list(self.domain_names)} if self.domain_names is not None else {}

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise FedfeatError(f"{self.format}: {self.root} is not a directory; expected {self.layout}")

    def _pick(self, found: list[str], wanted: list[str] | None) -> list[str]:
        """The requested subset of ``found`` (kept in ``found``'s order), or all of it."""
        if wanted is None:
            return found
        missing = [d for d in wanted if d not in found]
        if missing:
            raise FedfeatError(
                f"{self.format}: no domain {missing[0]!r} under {self.root} (it has: {', '.join(found)}); "
                "fix --domains"
            )
        return [d for d in found if d in wanted]

    def _require_files(self) -> None:
        """Every listed image exists, else one line naming the first missing one."""
        for split, paths in self._paths.items():
            missing = [p for p in paths if not (self.root / p).is_file()]
            if missing:
                raise FedfeatError(
                    f"{self.format}: {len(missing)} listed image(s) of split '{split}' are missing, first "
                    f"{self.root / missing[0]}; restore them or point --root at the folder that holds them"
                )


# ---------------------------------------------------------------------------------------- CoOp / Dassl
class CoOp(_DomainDataset):
    """CoOp's ``split_zhou_<Name>.json`` splits (Dassl's ``read_split``); one domain (``domains`` is None)."""

    format = "coop"
    layout = (
        "a CoOp dataset folder: split_zhou_<Name>.json (train/val/test lists of [path, label, classname]) "
        "and the image folder the paths are relative to (images/ for OxfordPets, 101_ObjectCategories/ for "
        "Caltech101, jpg/ for OxfordFlowers, ...)"
    )

    def __init__(self, root: Path):
        super().__init__(root)
        self._check_root()
        split_file = self._split_file()
        self.root = split_file.parent
        self._extra_files.append(split_file.name)
        doc = self._read_json(split_file)
        names: dict[int, str] = {}
        rows: dict[str, list[tuple[str, int]]] = {}
        for split in ("train", "val", "test"):
            items = doc.get(split)
            if not isinstance(items, list):
                raise FedfeatError(
                    f"{split_file}: no '{split}' list; expected {{'train': [[path, label, classname], ...], "
                    "'val': [...], 'test': [...]}} as CoOp writes it"
                )
            out = []
            for j, item in enumerate(items):
                ok = isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                ok = (
                    ok and isinstance(item[2], str) and re.fullmatch(r"\d+", str(item[1]).strip()) is not None
                )
                if not ok:
                    raise FedfeatError(
                        f"{split_file}: {split}[{j}] = {str(item)[:80]} is not [relative path, label, classname]; "
                        "re-download the split file"
                    )
                y = int(item[1])
                if names.setdefault(y, item[2]) != item[2]:
                    raise FedfeatError(
                        f"{split_file}: label {y} is named both {names[y]!r} and {item[2]!r}; "
                        "re-download the split file"
                    )
                out.append((item[0], y))
            if out:
                rows[split] = out
        if not rows:
            raise FedfeatError(f"{split_file} lists no images; expected {self.layout}")
        k = max(names) + 1
        gaps = [y for y in range(k) if y not in names]
        if gaps:
            raise FedfeatError(
                f"{split_file}: no image has label {gaps[0]} (labels run 0..{k - 1}); re-download the split file"
            )
        self.class_names = [clean_class_name(names[y]) for y in range(k)]
        prefix = self._image_dir(split_file, next(iter(rows.values()))[0][0])
        for split, out in rows.items():
            self._paths[split] = [os.path.join(prefix, p) if prefix else p for p, _ in out]
            self._labels[split] = np.asarray([y for _, y in out], dtype=np.int64)
        self._require_files()

    def _split_file(self) -> Path:
        found = sorted(self.root.glob("split_zhou_*.json"))
        if not found:  # CoOp's data folder, holding one dataset folder
            found = [self.root / d / f for f, (d, _) in SPLIT_FILES.items() if (self.root / d / f).is_file()]
        if len(found) != 1:
            what = f"{len(found)} ({', '.join(p.name for p in found)})" if found else "no"
            raise FedfeatError(
                f"{self.format}: {what} split_zhou_*.json files in {self.root}; expected {self.layout}"
            )
        return found[0]

    def _read_json(self, path: Path) -> dict:
        try:
            doc = json.loads(_read_text(path))
        except ValueError as e:
            raise FedfeatError(f"{path} is not valid JSON ({e}); re-download the split file") from None
        if not isinstance(doc, dict):
            raise FedfeatError(f"{path} holds no JSON object; expected {self.layout}")
        return doc

    def _image_dir(self, split_file: Path, first: str) -> str:
        """CoOp's image folder for this split file; for another name, the folder (or the root) that holds
        the first listed image."""
        known = SPLIT_FILES.get(split_file.name)
        if known is not None:
            return known[1]
        candidates = [""] + sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        for c in candidates:
            if (self.root / c / first).is_file():
                return c
        raise FedfeatError(
            f"{self.format}: the first listed image {first} is neither under {self.root} nor under one of its "
            "folders; put the image folder beside the split file"
        )


# ---------------------------------------------------------------------------------------- DomainNet
_LIST = re.compile(r"^(?P<domain>.+)_(?P<split>train|test)\.txt$")


class DomainNet(_DomainDataset):
    """DomainNet: per-domain ``<domain>_{train,test}.txt`` lists under one root; domains alphabetical."""

    format = "domainnet"
    options = ("domains",)
    layout = (
        "the DomainNet folder: <domain>/<class>/<image> and list files <domain>_train.txt, <domain>_test.txt "
        "of '<domain>/<class>/<file> <label>' lines"
    )

    def __init__(self, root: Path, domains=None):
        super().__init__(root)
        self._check_root()
        lists: dict[str, dict[str, Path]] = {}
        for p in sorted(root.glob("*_t*.txt")):
            m = _LIST.match(p.name)
            if m:
                lists.setdefault(m["domain"], {})[m["split"]] = p
        if not lists:
            raise FedfeatError(
                f"{self.format}: no <domain>_train.txt / <domain>_test.txt lists in {root}; expected {self.layout}"
            )
        self.domain_names = self._pick(sorted(lists), _domain_option(self.format, domains))
        names: dict[int, str] = {}
        for split in ("train", "test"):
            paths, labels, doms = [], [], []
            for d, dom in enumerate(self.domain_names):
                p = lists[dom].get(split)
                if p is None:
                    continue
                self._extra_files.append(p.name)
                n0 = len(paths)
                for i, line in enumerate(_read_text(p).splitlines()):
                    if not line.strip():
                        continue
                    parts = line.strip().rsplit(None, 1)
                    if len(parts) != 2 or not re.fullmatch(r"\d+", parts[1]):
                        raise FedfeatError(
                            f"{p}:{i + 1}: expected '<domain>/<class>/<file> <label>', got {line.strip()!r}"
                        )
                    segs = parts[0].split("/")
                    if len(segs) < 3:
                        raise FedfeatError(
                            f"{p}:{i + 1}: expected '<domain>/<class>/<file> <label>', got {line.strip()!r}"
                        )
                    y = int(parts[1])
                    if names.setdefault(y, segs[-2]) != segs[-2]:
                        raise FedfeatError(
                            f"{p}:{i + 1}: label {y} is class {segs[-2]!r} here and {names[y]!r} before; "
                            "fix the list file"
                        )
                    paths.append(parts[0])
                    labels.append(y)
                if len(paths) == n0:
                    raise FedfeatError(f"{p} lists no images; expected {self.layout}")
                doms += [d] * (len(paths) - n0)
            if paths:
                self._paths[split] = paths
                self._labels[split] = np.asarray(labels, dtype=np.int64)
                self._domains[split] = np.asarray(doms, dtype=np.int64)
        k = max(names) + 1
        gaps = [y for y in range(k) if y not in names]
        if gaps:
            raise FedfeatError(
                f"{self.format}: no listed image has label {gaps[0]} (labels run 0..{k - 1}), so its class "
                "name is unknown; read every domain (drop --domains) or fix the lists"
            )
        self.class_names = [clean_class_name(names[y]) for y in range(k)]
        self._require_files()


# ---------------------------------------------------------------------------------------- domain folders
PRESETS: dict[
    str, tuple[tuple[str, ...], ...]
] = {  # format -> domains in published order (accepted spellings)
    "pacs": (("art_painting",), ("cartoon",), ("photo",), ("sketch",)),
    "officehome": (("Art",), ("Clipart",), ("Product",), ("Real_World", "Real World")),
    "vlcs": (("Caltech101",), ("LabelMe",), ("SUN09",), ("VOC2007",)),
    "office-caltech10": (("amazon",), ("caltech",), ("dslr",), ("webcam",)),
}


class DomainFolder(_DomainDataset):
    """``root/<domain>/<class>/<image>``: one torchvision ImageFolder per domain, split as FedCLIP splits it."""

    format = "domainfolder"
    options = ("domains",)
    published: tuple[tuple[str, ...], ...] = ()  # the presets' domain folders, in order
    layout = "root/<domain>/<class>/<image> (e.g. photo/dog/0001.jpg), images with extensions " + " ".join(
        IMG_EXTENSIONS
    )

    def __init__(self, root: Path, domains=None):
        super().__init__(root)
        self._check_root()
        folders = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if self.published:
            found = []
            for spellings in self.published:
                hit = next((s for s in spellings if s in folders), None)
                if hit is None:
                    raise FedfeatError(
                        f"{self.format}: no domain folder {spellings[0]} in {root}; expected {self.layout}"
                    )
                found.append(hit)
        else:
            found = folders
            if not found:
                raise FedfeatError(f"{self.format}: no domain folders in {root}; expected {self.layout}")
        self.domain_names = self._pick(found, _domain_option(self.format, domains))
        per_domain = []
        for dom in self.domain_names:
            classes, samples = torchvision_imagefolder(root / dom)
            if not classes:
                raise FedfeatError(
                    f"{self.format}: domain folder {root / dom} has no class folders; expected {self.layout}"
                )
            if not samples:
                raise FedfeatError(f"{self.format}: no images under {root / dom}; expected {self.layout}")
            per_domain.append((dom, classes, samples))
        raw = sorted(set().union(*(set(c) for _, c, _ in per_domain)))
        index = {c: k for k, c in enumerate(raw)}
        self.class_names = [clean_class_name(c) for c in raw]
        out: dict[str, tuple[list, list, list]] = {s: ([], [], []) for s in ("train", "val", "test", "rest")}
        for d, (dom, classes, samples) in enumerate(per_domain):
            for split, rows in fedclip_split(len(samples)).items():
                paths, labels, doms = out[split]
                for r in rows:
                    rel, k = samples[r]
                    paths.append(f"{dom}/{rel}")
                    labels.append(index[classes[k]])
                    doms.append(d)
        for split, (paths, labels, doms) in out.items():
            if paths:
                self._paths[split] = paths
                self._labels[split] = np.asarray(labels, dtype=np.int64)
                self._domains[split] = np.asarray(doms, dtype=np.int64)

    def fingerprint_extra(self) -> dict:
        return {
            "domain_names": list(self.domain_names or []),
            "split": {"rule": "fedclip", "seed": FEDCLIP_SEED, "fractions": list(FEDCLIP_FRACTIONS)},
        }


def _preset(fmt: str, cls_name: str, title: str) -> type[DomainFolder]:
    doms = PRESETS[fmt]
    layout = f"the {title} folder: " + ", ".join(s[0] for s in doms) + " domain folders, each <class>/<image>"
    return type(cls_name, (DomainFolder,), {"format": fmt, "published": doms, "layout": layout})


PACS = _preset("pacs", "PACS", "PACS")
OfficeHome = _preset("officehome", "OfficeHome", "OfficeHome")
VLCS = _preset("vlcs", "VLCS", "VLCS")
OfficeCaltech10 = _preset("office-caltech10", "OfficeCaltech10", "Office-Caltech10")

DOMAIN_DATASETS = {
    "coop": CoOp,
    "domainnet": DomainNet,
    "domainfolder": DomainFolder,
    "pacs": PACS,
    "officehome": OfficeHome,
    "vlcs": VLCS,
    "office-caltech10": OfficeCaltech10,
}
