"""``class-blocks``: FedTPG's cross-class split -- each dataset's classes cut into consecutive blocks, one block per
client, and ``shots`` images of each of a client's classes.

Source: FedTPG, ``boschresearch/FedTPG`` @ f141c29: ``federated/server.py:97-132`` ``init_server`` and
``dataloader/dm_federated.py:33-60`` ``ClassSampler``, transcribed call for call:

1. per dataset (a domain of a combined store, ``fedfeat combine``, in the store's order; a store without domains is
   one dataset): its classes ``m`` (the base ones under ``--base-novel``, FedTPG's ``TRAIN.SPLIT = 'base'``:
   ``math.ceil(n / 2)``), ``np.around(m / block_classes)`` clients (at least 1), client ``j`` the classes
   ``[j b, (j + 1) b)``, the dataset's last client the rest (``all_cls_idx[(client_id - last) * b:]``);
2. each client: ``random.seed(seed)``, then for each of its classes in order ``random.sample(valid_idx, shots)``
   over the positions of the class's images in the dataset's order (all of them where there are fewer:
   the ``except`` branch). The seed is the run's (FedTPG's ``--seed`` default 43, ``Launch_FL.py``).

FedTPG's class counts are hard-coded (``dataset_classnum``: Caltech101 100, ...); here they are the store's. FedTPG
relabels a client's classes 0..k-1 and classifies among them only: the methods' ``classes="client"`` reading
(``fedfeat.methods.promptfl.FedTPGParams``), not the partition's.
"""

import random
from dataclasses import dataclass, field

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.registry import Draw, KeyPart, Scheme, register_scheme

FEDTPG_SEED = 43  # Launch_FL.py: --seed default 43 (cfg.SEED)
FEDTPG_BLOCK = 20  # Launch_FL.py: --num_cls_per_client 20 (cfg.TRAIN.NUM_CLASS_PER_CLIENT)
FEDTPG_SHOTS = 8  # Launch_FL.py: --num_shots 8


def _at_least_one(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v} (FedTPG: 20 classes per client)"


def _shots_at_least_one(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v} (FedTPG: 8)"


def class_blocks(d: Draw, block: int, shots: int) -> tuple[list[np.ndarray], list[int]]:
    """``(clients, each client's domain index)``: positions into ``d.labels`` (module docstring)."""
    doms = d.domains if d.domains is not None else np.zeros(len(d.labels), dtype=np.int64)
    parts, owner = [], []
    for dom in range(int(doms.max(initial=-1)) + 1):
        rows = np.flatnonzero(doms == dom)
        if not len(rows):
            continue
        # the dataset's (base) classes, in label order: a combined store's own, else the store's (FedTPG's
        # all_cls_idx = np.arange(m), whether or not a class has images)
        classes = np.asarray(
            d.class_groups[dom] if d.class_groups else np.arange(d.n_classes), dtype=np.int64
        )
        m = len(classes)
        n = max(int(np.around(m / block)), 1)
        for j in range(n):
            mine = classes[j * block :] if j == n - 1 else classes[j * block : (j + 1) * block]
            if not len(mine):
                continue
            py = random.Random(d.seed)  # ClassSampler: random.seed(seed) for every client
            got = []
            for c in mine:
                valid = rows[d.labels[rows] == c].tolist()
                got += py.sample(valid, shots) if len(valid) >= shots else valid
            parts.append(np.asarray(got, dtype=np.int64))
            owner.append(dom)
    if len(parts) != d.clients:
        raise FedfeatError(
            f"class-blocks: the datasets' classes in blocks of {block} make {len(parts)} clients, not {d.clients}; "
            f"pass --clients {len(parts)}"
        )
    return parts, owner


@register_scheme
class ClassBlocks(Scheme):
    name = "class-blocks"
    summary = "each dataset's classes in consecutive blocks, one per client, shots images of each (FedTPG)"
    source = "FedTPG init_server / ClassSampler (boschresearch/FedTPG federated/server.py, dataloader/dm_federated.py)"
    order = 90
    seed = FEDTPG_SEED
    uses_domains = True
    takes_imbalance = False

    @dataclass(frozen=True)
    class Params:
        block_classes: int = field(
            default=FEDTPG_BLOCK,
            metadata={"help": "classes per client: consecutive blocks of each dataset's classes (FedTPG: 20)",
                      "example": "10", "check": _at_least_one},
        )  # fmt: skip
        shots: int = field(
            default=FEDTPG_SHOTS,
            metadata={
                "help": "samples per class and client, few-shot",
                "example": "10",
                "check": _shots_at_least_one,
            },
        )

    store_defaults = {"block_classes": FEDTPG_BLOCK, "shots": FEDTPG_SHOTS}
    key_parts = (KeyPart("block_classes", "b", "{} classes per client"), KeyPart("shots", "shot", "{} shots"))
    words = "class blocks of {block_classes}, {shots} shots"

    @classmethod
    def draw(cls, d: Draw, params):
        parts, owner = class_blocks(d, params.block_classes, params.shots)
        extra: dict = {}
        if d.domains is not None:
            names = list(d.domain_names) or [f"domain {i}" for i in range(max(owner) + 1)]
            extra["client_domains"] = [names[o] for o in owner]
        return parts, extra
