"""``dirichlet-joint``: FedCoPL's Dirichlet split of the train and test splits with the same draws."""

from dataclasses import dataclass, field

from fedfeat.partition.kinds.dirichlet import ALPHA, ALPHA_KEY
from fedfeat.partition.registry import Draw, Scheme, register_scheme
from fedfeat.partition.schemes import FEDCOPL_SEED, dirichlet_joint


@register_scheme
class DirichletJoint(Scheme):
    name = "dirichlet-joint"
    summary = "Dirichlet label skew drawn once for the train and test splits (per-client test sets)"
    source = "FedCoPL prepare_dataset_UL_fed, partition 'noniid' (krumpguo/FedCoPL methods/main_UL.py)"
    order = 60
    seed = FEDCOPL_SEED
    takes_imbalance = False
    needs_test_labels = True
    inputs_message = (
        "scheme 'dirichlet-joint' partitions the train and test splits together: it needs the test labels "
        "(a store with a test split) and no imbalance factor"
    )

    @dataclass(frozen=True)
    class Params:
        alpha: float = field(metadata=ALPHA)  # FedCoPL's beta (reference code)

    store_defaults = {"alpha": 0.1}
    key_parts = (ALPHA_KEY,)
    words = "Dir(α = {alpha}) on train and test"

    @classmethod
    def draw(cls, d: Draw, params):
        train, test = dirichlet_joint(
            d.labels, d.test_labels, d.clients, params.alpha, d.seed, n_classes=d.n_classes
        )
        return train, {"test_clients": [t.tolist() for t in test]}
