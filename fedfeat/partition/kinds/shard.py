"""``shard``: label-sorted shards, ``shards`` per client (FedNTD ``sharding_partition``)."""

from dataclasses import dataclass, field

from fedfeat.partition.registry import Draw, KeyPart, Scheme, register_scheme
from fedfeat.partition.schemes import FEDNTD_SEED, shard


def _at_least_one(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v}"


@register_scheme
class Shard(Scheme):
    name = "shard"
    summary = "label-sorted shards, a number per client (McMahan et al.'s pathological split)"
    source = "FedNTD sharding_partition (Lee-Gihun/FedNTD train_tools/preprocessing/datasetter.py)"
    order = 20
    seed = FEDNTD_SEED

    @dataclass(frozen=True)
    class Params:
        shards: int = field(  # FedNTD's shard_per_user; its default 2 (reference code)
            default=2,
            metadata={
                "help": "shards per client (label-sorted shards)",
                "example": "2",
                "check": _at_least_one,
            },
        )

    store_defaults = {"shards": 2}
    key_parts = (KeyPart("shards", "sh", "{} shards per client"),)

    @classmethod
    def draw(cls, d: Draw, params):
        return shard(d.labels, d.clients, params.shards, d.seed), {}

    @classmethod
    def describe(cls, values):
        n = values.get("shards")
        return f"{n} shard{'s' if n != '1' else ''} per client" if n else cls.name
