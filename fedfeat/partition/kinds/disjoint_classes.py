"""``disjoint-classes``: Fed-MP's base/novel split, disjoint classes per client and ``shots`` samples of each."""

from dataclasses import dataclass, field

import numpy as np

from fedfeat.partition.registry import Draw, KeyPart, Scheme, register_scheme
from fedfeat.partition.schemes import FEDMP_SEED, disjoint_classes


def _at_least_one(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v} (Fed-MP: 10)"


@register_scheme
class DisjointClasses(Scheme):
    name = "disjoint-classes"
    summary = (
        "C // (clients + 1) disjoint classes per client, shots samples of each; the rest are novel classes"
    )
    source = "Fed-MP caltech_split_clients (huiminzeng/Fed-MP dataset/utils.py)"
    order = 50
    seed = FEDMP_SEED
    takes_class_order = True

    @dataclass(frozen=True)
    class Params:
        shots: int = field(  # Fed-MP's --num_shots (reference code); no default here: the scheme needs it
            metadata={
                "help": "samples per class and client, few-shot",
                "example": "10",
                "check": _at_least_one,
            }
        )

    store_defaults = {"shots": 10}
    key_parts = (
        KeyPart("shots", "shot", "{} shots"),
        KeyPart("class_order", "o", "{} class order", "text", True),
    )
    words = "disjoint classes, {shots} shots"

    @classmethod
    def draw(cls, d: Draw, params):
        parts, novel = disjoint_classes(
            d.labels, d.clients, params.shots, d.seed, n_classes=d.n_classes, order=d.class_order
        )
        extra: dict = {"novel_classes": novel.tolist()}
        if d.class_order is not None:
            extra["class_order"] = str(d.class_order_name)
            extra["class_order_ids"] = np.asarray(d.class_order).tolist()
        return parts, extra
