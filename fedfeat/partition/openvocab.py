"""The open-vocabulary setting (Fed-MP): clients hold disjoint base classes; the federation is asked about novel ones.

``--partition disjoint-classes --shots n`` (``fedfeat.partition.schemes.disjoint_classes``: ``C // (clients + 1)`` classes
per client, ``n`` shots each; the classes no client drew are the *novel* classes) makes a run open-vocabulary:

* **Class order.** The draws pick positions in a class list; the reference code's is its own (sorted folder names;
  Flowers' labels 1..102; the sorted Cars / FGVC names), which a store's label order need not follow (Flowers read
  as an ImageFolder sorts "1", "10", "100", ...: then 2 of the 12 novel classes are the paper's). With ``--preset``,
  the run's ``class_order`` is ``"preset"``: the store's classes are matched by name (``normalise_class_name``) to
  ``classlists/<preset>.txt`` and drawn in that order (a preset class the store lacks is an error);
  ``--class-order store`` draws in the store's order (synthetic stand-ins, whose classes are ``class_000`` ...). The
  partition key of a preset-ordered draw ends ``-o<preset>``. ``--preset`` also sets fed-mp's ε (``epsilon``).
* **Local train / validation.** Each client's shots are split (``local_val``):
  ``"paper"`` (default; Fed-MP §4: 10 shots of which 2 for validation): the last ``round(0.2 n)`` shots of each of
  its classes (the shots are already a random draw) are its validation set; ``"code"`` (Fed-MP's
  ``client_utils.py``): a ``np.random.seed(0)`` permutation of the client's samples, the first 80 % (floor) train;
  ``"none"``: every shot trains. Only the train part reaches the engine's client-major features.
* **The query set.** The images of the novel classes, from the store's ``test`` split (from ``train`` when a store
  has no test split: Fed-MP's Caltech / Food / Flowers / UCF take them from the same folders). ``query_val``:
  ``"paper"`` (default; Fed-MP §4: 20 % validation / 80 % test per novel class, seeded) or ``"code"`` (all test).
* **Evaluation** runs over the novel vocabulary only: a prediction is the argmax over the novel classes. Per round:
  ``test_acc`` (novel accuracy), ``novel_precision`` / ``novel_recall`` / ``novel_f1`` (sklearn's macro definitions
  over the novel classes, 0 where a class is never predicted), and for reference ``base_acc`` (the test images of
  the clients' classes, over the base vocabulary: CoOp's base-to-novel protocol) and ``hm`` (their harmonic mean).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from fedfeat.errors import FedfeatError

# Fed-MP's datasets (``dataset/utils.py``): client i draws its classes with ``np.random.seed(i + offset)``; in
# fedfeat's ``disjoint_classes`` that is ``partition_seed = offset - 1``. ``epsilon``: the confidence threshold ε of
# multimodal prototyping as a fraction of the maximum entropy, per dataset (paper Appendix A, "Hyperparameters":
# 20 % on Caltech101 / UCF101 / Flower102, 30 % on FGVC / Food101, 10 % on StanfordCars; the code has no per-dataset
# value: eval.py's --uncertainty defaults to 0.1 and its README gives no run scripts). ``names``: the class names as
# the reference code forms them; the class order it draws from is ``classlists/<preset>.txt`` (``preset_class_names``).
PRESETS = {
    "caltech101": {"seed": 0, "classes": 102, "epsilon": 0.2, "names": "folder names as they are (BACKGROUND_Google and Faces_easy kept)"},
    "food101": {"seed": 0, "classes": 101, "epsilon": 0.3, "names": "folder names as they are (apple_pie)"},
    "flowers102": {"seed": 0, "classes": 102, "epsilon": 0.2, "names": "flower_attribute_dict's 102 names (flower_data/train)"},
    "ucf101": {"seed": -1, "classes": 101, "epsilon": 0.2, "names": "folder names with CamelCase split into words"},
    "fgvc-aircraft": {"seed": -1, "classes": 70, "epsilon": 0.3, "names": "family strings (images_family_*.txt)"},
    "stanford-cars": {"seed": 1, "classes": 196, "epsilon": 0.1, "names": "cars_annos.mat class names"},
}  # fmt: skip
PRESET_RUN = {"partition": "disjoint-classes", "shots": 10, "clients": 10, "participation": 1.0, "rounds": 2}
# the reference code's --dataset names (train.py) and other spellings -> preset
_PRESET_ALIASES = {"caltech": "caltech101", "food": "food101", "flower102": "flowers102", "flowers": "flowers102",
                   "oxfordflowers": "flowers102", "ucf": "ucf101", "fgvc": "fgvc-aircraft", "fgvcaircraft": "fgvc-aircraft",
                   "aircraft": "fgvc-aircraft", "cars": "stanford-cars", "stanfordcars": "stanford-cars"}  # fmt: skip
# which class order a disjoint-classes partition draws from: "preset" (the preset's list, matched to the store's
# classes by name) or "store" (the store's class ids, e.g. synthetic stand-ins whose classes are class_000 ...)
CLASS_ORDERS = ("store", "preset")

LOCAL_VAL = ("paper", "code", "none")
QUERY_VAL = ("paper", "code")


@dataclass
class OpenVocab:
    """What an open-vocabulary run adds to the engine's data (class ids are the store's)."""

    base: torch.Tensor  # [Kb] int64 classes some client holds, sorted
    novel: torch.Tensor  # [Kn] int64 classes no client holds, sorted
    client_classes: list[torch.Tensor]  # per client: its class ids in draw order ([Kc] each)
    local_index: (
        torch.Tensor
    )  # [N] int64 per training row (client-major): its class's index in its client's list
    val_x: torch.Tensor  # [Nv, D] the clients' local validation shots, client-major
    val_y: torch.Tensor  # [Nv]
    val_offsets: torch.Tensor  # [clients + 1]
    query_x: torch.Tensor  # [Nq, D] the novel classes' test images (the query set)
    query_y: torch.Tensor  # [Nq]
    qval_x: torch.Tensor  # [Nqv, D] the query set's validation part ("paper"); empty for "code"
    qval_y: torch.Tensor  # [Nqv]
    base_x: torch.Tensor  # [Nb, D] test images of the base classes (base accuracy)
    base_y: torch.Tensor  # [Nb]


def preset_name(dataset: str) -> str:
    """The preset of a dataset name in any common spelling (``"flower102"``, ``"FGVC"``, ``"stanford_cars"``)."""
    if dataset in PRESETS:
        return dataset
    key = re.sub(r"[^a-z0-9]", "", (dataset or "").lower())
    name = _PRESET_ALIASES.get(key) or next((p for p in PRESETS if re.sub(r"[^a-z0-9]", "", p) == key), None)
    if name is None:
        raise FedfeatError(f"no Fed-MP preset for dataset {dataset!r}; known presets: {', '.join(PRESETS)}")
    return name


def fedmp_preset_params(dataset: str) -> dict:
    """fed-mp's per-dataset hyperparameters (string values, as ``--set`` takes them): the confidence threshold ε,
    the ``uncertainty`` param (Fed-MP Appendix A).

    >>> fedmp_preset_params("flowers102"), fedmp_preset_params("fgvc")
    ({'uncertainty': '0.2'}, {'uncertainty': '0.3'})
    """
    return {"uncertainty": str(PRESETS[preset_name(dataset)]["epsilon"])}


def normalise_class_name(name: str) -> str:
    """The form class names are compared in: case-folded, every ``_`` and white space removed, so that a folder name
    (``Faces_easy``, ``ApplyEyeMakeup``), its prompt form (``apple pie``, ``Apply Eye Makeup``) and CoOp's
    (``Apply_Eye_Makeup``) are one name.

    >>> normalise_class_name("Apply_Eye Makeup") == normalise_class_name("ApplyEyeMakeup")
    True
    """
    return re.sub(r"[\s_]+", "", str(name)).casefold()


def preset_class_names(preset: str) -> list[str]:
    """The preset's classes in the order the reference code draws them from (package data
    ``fedfeat/partition/classlists/<preset>.txt``; its header cites the source)."""
    from importlib.resources import files

    text = files("fedfeat.partition").joinpath("classlists", f"{preset}.txt").read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def preset_class_order(preset: str, store_names: list[str]) -> np.ndarray:
    """``order  # [C]`` int64: the store's class id of each of the preset's classes, in the preset's order (names
    compared by ``normalise_class_name``); a preset class the store lacks is a one-line ``FedfeatError``."""
    want = preset_class_names(preset)
    ids: dict[str, int] = {}
    for i, n in enumerate(store_names):
        if ids.setdefault(normalise_class_name(n), i) != i:
            raise FedfeatError(
                f"the store's classes {store_names[ids[normalise_class_name(n)]]!r} and {n!r} are one name to preset "
                f"{preset} (case, '_' and spaces ignored); rename one, or pass --class-order store"
            )
    missing = [n for n in want if normalise_class_name(n) not in ids]
    if missing:
        raise FedfeatError(
            f"preset {preset}: {len(missing)} of its {len(want)} classes are not in the store (first: {missing[0]!r}; "
            f"case, '_' and spaces ignored); encode the store with the class names of "
            f"fedfeat/partition/classlists/{preset}.txt, or pass --class-order store to draw in the store's order"
        )
    return np.array([ids[normalise_class_name(n)] for n in want], dtype=np.int64)


def class_order_mode(class_order: str | None, preset: str | None) -> str:
    """The class order a run draws its disjoint classes in: as set, else ``"preset"`` with a preset, else
    ``"store"``."""
    mode = class_order or ("preset" if preset is not None else "store")
    if mode not in CLASS_ORDERS:
        raise FedfeatError(f"--class-order must be one of {', '.join(CLASS_ORDERS)}, got {class_order!r}")
    if mode == "preset" and preset is None:
        raise FedfeatError(
            "--class-order preset needs --preset (the preset's class list); or drop --class-order"
        )
    return mode


def check_modes(local_val: str, query_val: str) -> None:
    if local_val not in LOCAL_VAL:
        raise FedfeatError(f"local_val must be one of {', '.join(LOCAL_VAL)}, got {local_val!r}")
    if query_val not in QUERY_VAL:
        raise FedfeatError(f"query_val must be one of {', '.join(QUERY_VAL)}, got {query_val!r}")


def local_split(clients: list[np.ndarray], labels: np.ndarray, mode: str) -> tuple[list, list]:
    """Each client's positions split into (train, validation) lists of int64 arrays (see the module docstring)."""
    train, val = [], []
    for pos in clients:
        pos = np.asarray(pos, dtype=np.int64)
        if mode == "none" or len(pos) == 0:
            train.append(pos)
            val.append(pos[:0])
        elif mode == "code":  # Fed-MP client_utils.py: np.random.seed(0); permutation; 80 % train
            perm = np.random.RandomState(0).permutation(len(pos))
            cut = int(0.8 * len(pos))
            train.append(pos[perm[:cut]])
            val.append(pos[perm[cut:]])
        else:  # paper: per class, the last round(0.2 n) of its shots validate (10 shots -> 8 train, 2 val)
            y = labels[pos]
            keep = np.ones(len(pos), dtype=bool)
            for c in dict.fromkeys(y.tolist()):
                idx = np.flatnonzero(y == c)
                nv = int(round(0.2 * len(idx)))
                if 0 < nv < len(idx):
                    keep[idx[-nv:]] = False
            train.append(pos[keep])
            val.append(pos[~keep])
    return train, val


def class_lists(clients: list[np.ndarray], labels: np.ndarray) -> list[np.ndarray]:
    """Each client's class ids in the order they first appear among its positions (its draw order)."""
    return [np.array(list(dict.fromkeys(labels[np.asarray(p)].tolist())), dtype=np.int64) for p in clients]


def query_split(y: np.ndarray, mode: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the query set's (validation, test) parts: ``"paper"`` 20 % of each class validates (a seeded
    permutation per class), ``"code"`` everything tests."""
    if mode == "code":
        return np.zeros(0, dtype=np.int64), np.arange(len(y), dtype=np.int64)
    rs = np.random.RandomState(seed)
    val, test = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        idx = idx[rs.permutation(len(idx))]
        nv = int(round(0.2 * len(idx)))
        val.append(idx[:nv])
        test.append(idx[nv:])
    return np.sort(np.concatenate(val)).astype(np.int64), np.sort(np.concatenate(test)).astype(np.int64)


def macro_prf(pred: torch.Tensor, y: torch.Tensor, classes: torch.Tensor) -> tuple[float, float, float]:
    """sklearn's ``precision_recall_fscore_support(average="macro", labels=classes, zero_division=0)``: per class
    P = TP / predicted, R = TP / true, F1 = 2PR / (P + R) (0 where a denominator is 0), averaged over ``classes``.

    >>> macro_prf(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2]))
    (0.3333333333333333, 0.5, 0.38888888888888884)
    """
    c = classes.view(-1, 1).to(pred.device)
    is_pred = pred.view(1, -1) == c  # [K, N]
    is_true = y.view(1, -1) == c
    tp = (is_pred & is_true).sum(1).double()
    npred, ntrue = is_pred.sum(1).double(), is_true.sum(1).double()
    p = torch.where(npred > 0, tp / npred.clamp_min(1), torch.zeros_like(tp))
    r = torch.where(ntrue > 0, tp / ntrue.clamp_min(1), torch.zeros_like(tp))
    f = torch.where(p + r > 0, 2 * p * r / (p + r).clamp_min(1e-300), torch.zeros_like(tp))
    return float(p.mean()), float(r.mean()), float(f.mean())


def harmonic_mean(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return 0.0 if a + b == 0 else 2 * a * b / (a + b)
