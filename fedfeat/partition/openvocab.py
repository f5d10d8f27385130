"""The open-vocabulary setting (Fed-MP): clients hold disjoint base classes; the federation is asked about novel ones.

``--partition disjoint-classes --shots n`` (``fedfeat.partition.schemes.disjoint_classes``: ``C // (clients + 1)`` classes
per client, ``n`` shots each; the classes no client drew are the *novel* classes) makes a run open-vocabulary:

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

from dataclasses import dataclass

import numpy as np
import torch

from fedfeat.errors import FedfeatError

# Fed-MP's datasets (``dataset/utils.py``): client i draws its classes with ``np.random.seed(i + offset)``; in
# fedfeat's ``disjoint_classes`` that is ``partition_seed = offset - 1``. Class names as the reference code forms
# them (give them to ``fedfeat encode`` as the dataset's class-name file where the folder names differ).
PRESETS = {
    "caltech101": {"seed": 0, "classes": 102, "names": "folder names as they are (BACKGROUND_Google and Faces_easy kept)"},
    "food101": {"seed": 0, "classes": 101, "names": "folder names as they are (apple_pie)"},
    "flowers102": {"seed": 0, "classes": 102, "names": "flower_attribute_dict's 102 names (flower_data/train)"},
    "ucf101": {"seed": -1, "classes": 101, "names": "folder names with CamelCase split into words"},
    "fgvc-aircraft": {"seed": -1, "classes": 70, "names": "family strings (images_family_*.txt)"},
    "stanford-cars": {"seed": 1, "classes": 196, "names": "cars_annos.mat class names"},
}  # fmt: skip
PRESET_RUN = {"partition": "disjoint-classes", "shots": 10, "clients": 10, "participation": 1.0, "rounds": 2}

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
