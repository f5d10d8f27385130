"""Federated methods: one module per method family, registered by name with ``@register``.

A method is a params dataclass (every field commented with its source) plus a few hooks that the engine calls for
all sampled clients at once (``base.Method``; README, "Your own method"). ``fedfeat methods`` prints the registry;
other packages add methods through the ``fedfeat.methods`` entry point group (``load_plugins``).

Families (independent of each other: ``zeroshot``, ``linear``, ``fst_cbdg``, ``synthesis``, ``fedmp``, ``promptfl``,
``fedcopl``) share code only through the engine and the parts below them: the pseudo-labellers (``copl``, then
``pseudolabel``), the linear head (``head``) and the protocol and registry (``base``).

May import: ``fedfeat.engine`` and everything below it. Never ``fedfeat.runs``, ``fedfeat.report`` or the CLI.

Example::

    >>> from fedfeat.methods import get_method
    >>> m = get_method("fedprox", {"mu": 0.1})
    >>> m.p.mu, m.uses_labels
    (0.1, True)
"""

from __future__ import annotations

# the modules below register their methods on import (import order = listing order)
# isort: off
from fedfeat.methods import zeroshot, linear, fst_cbdg, synthesis  # noqa: E402, F401
from fedfeat.methods import fedmp, promptfl, fedcopl  # noqa: E402, F401

# CLIP2FL Table 1's other baselines and FedCoPL's pFedPrompt / FedOPT
from fedfeat.methods import fednova, focal, ratio_loss, tau_norm, ccvr, feddf, fedbe  # noqa: E402, F401
from fedfeat.methods import pfedprompt, fedopt  # noqa: E402, F401
from fedfeat.methods import serveropt  # noqa: E402, F401  # FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021)
from fedfeat.methods import scaffold, feddyn  # noqa: E402, F401  # SCAFFOLD, FedDyn (issue 35)

# isort: on
from fedfeat.methods.base import (  # noqa: E402
    CAPABILITIES,
    REGISTRY,
    Method,
    capabilities,
    get_method,
    method_table,
    register,
)
from fedfeat.methods.head import LinearHead, LinearHeadParams  # noqa: E402

ENTRY_POINT_GROUP = "fedfeat.methods"


def load_plugins() -> list[str]:
    """Import the methods other packages declare under the ``fedfeat.methods`` entry point group (pyproject:
    ``[project.entry-points."fedfeat.methods"] mymethod = "mypkg.mymethod"``); a module registers its classes with
    ``@register`` on import, and an entry point may also name a ``Method`` subclass, registered here. Returns the
    names loaded. A plugin that fails to import is a one-line error naming it."""
    from importlib.metadata import entry_points

    from fedfeat.errors import FedfeatError

    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # a third-party import error of any kind
            raise FedfeatError(
                f"method plugin {ep.name} ({ep.value}) failed to import: {type(e).__name__}: {e}; fix or uninstall "
                "the package that declares it"
            ) from None
        if isinstance(obj, type) and issubclass(obj, Method) and obj.name not in REGISTRY:
            register(obj)
        loaded.append(ep.name)
    return loaded


load_plugins()

__all__ = [
    "CAPABILITIES",
    "REGISTRY",
    "LinearHead",
    "LinearHeadParams",
    "Method",
    "capabilities",
    "get_method",
    "method_table",
    "register",
]
