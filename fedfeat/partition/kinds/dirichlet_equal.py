"""``dirichlet-equal``: CLIP2FL's chunked Dirichlet, re-cut into clients of equal size (``clients_indices``)."""

from dataclasses import dataclass, field

from fedfeat.partition.kinds.dirichlet import ALPHA, ALPHA_KEY
from fedfeat.partition.registry import Draw, Scheme, register_scheme
from fedfeat.partition.schemes import CLIP2FL_SEED, dirichlet_equal


@register_scheme
class DirichletEqual(Scheme):
    name = "dirichlet-equal"
    summary = "Dirichlet over chunks of 10 workers, re-cut into equal-size clients (needs >= 10 clients)"
    source = "CLIP2FL / CReFF clients_indices (shijiangming1/CLIP2FL Dataset/sample_dirichlet.py)"
    order = 40
    seed = CLIP2FL_SEED

    @dataclass(frozen=True)
    class Params:
        alpha: float = field(metadata=ALPHA)  # CLIP2FL's --non_iid_alpha (reference code; its default 0.5)

    store_defaults = {"alpha": 0.5}
    key_parts = (ALPHA_KEY,)
    words = "Dir(α = {alpha}), equal sizes"

    @classmethod
    def draw(cls, d: Draw, params):
        return dirichlet_equal(d.labels, d.clients, params.alpha, d.seed, n_classes=d.n_classes), {}
