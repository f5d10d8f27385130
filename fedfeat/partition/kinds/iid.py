"""``iid``: uniform random clients of equal size (FedNTD ``iid_partition``)."""

from fedfeat.partition.registry import Draw, Scheme, register_scheme
from fedfeat.partition.schemes import FEDNTD_SEED, iid


@register_scheme
class IID(Scheme):
    name = "iid"
    summary = "uniform random clients of int(N / clients) samples each (the remainder is dropped)"
    source = "FedNTD iid_partition (Lee-Gihun/FedNTD train_tools/preprocessing/datasetter.py)"
    order = 10
    seed = FEDNTD_SEED
    words = "IID"

    @classmethod
    def draw(cls, d: Draw, params):
        return iid(d.labels, d.clients, d.seed), {}
