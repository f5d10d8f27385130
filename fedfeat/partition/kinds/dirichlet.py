"""``dirichlet``: per-class Dirichlet label skew (FedNTD ``lda_partition``, the FedML rule), with its minimum
client size as a named reading (``min_size``)."""

import math
from dataclasses import dataclass, field

from fedfeat.partition.registry import Draw, KeyPart, Scheme, register_scheme
from fedfeat.partition.schemes import FEDNTD_SEED, _int, dirichlet

FEDNTD_MIN_SIZE = 10  # FedNTD lda_partition: `while min_size < 10` (schemes.dirichlet)


def _positive_finite(v) -> str | None:
    return None if math.isfinite(v) and v > 0 else f"must be a finite number > 0, got {v} (e.g. 0.1 or 0.5)"


def _at_least_zero(v) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v} (FedNTD: 10; 0 accepts the first draw)"


# the Dirichlet schemes' alpha: one help and one key part for all three (the registry checks that they agree);
# "check": the range check of the run specification and the CLI (value -> complaint or None)
ALPHA = {
    "help": "Dirichlet concentration, smaller = more skewed",
    "example": "0.5",
    "check": _positive_finite,
}
ALPHA_KEY = KeyPart("alpha", "a", "α = {}", kind="real")
MIN_SIZE = {
    "help": "redraw until every client holds >= N samples (default FedNTD's 10)",
    "example": "1",
    "check": _at_least_zero,
}


@register_scheme
class Dirichlet(Scheme):
    name = "dirichlet"
    summary = "per-class Dirichlet label skew, redrawn until every client holds min_size samples"
    source = "FedNTD lda_partition (Lee-Gihun/FedNTD train_tools/preprocessing/datasetter.py), the FedML rule"
    order = 30
    seed = FEDNTD_SEED

    @dataclass(frozen=True)
    class Params:
        # FedNTD's dir_alpha (reference code); no default: the scheme needs it
        alpha: float = field(metadata=ALPHA)
        # None = FedNTD's 10 (reference code); another value is ours, a named reading for unmeetable settings
        min_size: int | None = field(default=None, metadata=MIN_SIZE)

    store_defaults = {"alpha": 0.1}
    implied_values = {"min_size": FEDNTD_MIN_SIZE}  # min_size None draws with FedNTD's 10
    key_parts = (ALPHA_KEY, KeyPart("min_size", "m", "min size {}", after=True))
    words = "Dir(α = {alpha})"

    @classmethod
    def check(cls, params):
        if params.min_size is not None:
            _int("min_size", params.min_size, 0, "use --min-size 0 or more (FedNTD: 10)")
        return params

    @classmethod
    def draw(cls, d: Draw, params):
        minimum = FEDNTD_MIN_SIZE if params.min_size is None else params.min_size
        return dirichlet(d.labels, d.clients, params.alpha, d.seed, min_size=minimum), {}

    @classmethod
    def record(cls, params) -> dict:
        """alpha; min_size only when not FedNTD's 10 (the partitions, params and key of before the switch)."""
        out = {"alpha": float(params.alpha)}
        if params.min_size is not None and params.min_size != FEDNTD_MIN_SIZE:
            out["min_size"] = int(params.min_size)
        return out
